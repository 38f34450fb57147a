"""Task planning: which steps share a thread (operator chaining, as in Flink), and which thread
does each step's work."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Collection, Mapping, Sequence

from aisp.graph import Node, split_ref

__all__ = ["CHAINABLE", "CHAIN_UPSTREAM", "MODEL_KINDS", "assign_tasks", "tasks", "thread_of"]

CHAINABLE = frozenset(
    {"map_batch", "map", "filter", "key_by", "stateful", "route", "union", "sink", "infer", "llm"}
)
MODEL_KINDS = frozenset({"infer", "llm"})
"""Steps whose rows move on from threads of their own (a batcher's dispatchers, an LLM step's loop)."""
CHAIN_UPSTREAM = frozenset(
    {"source", "map_batch", "map", "filter", "key_by", "stateful", "window", "join", "route", "union"}
)


def assign_tasks(
    nodes: Mapping[str, Node], consumers: Mapping[tuple[str, str], Sequence[str]]
) -> dict[str, str]:
    """Step id -> its task: each step chains into its upstream's thread where that is safe and
    saves a hand-off.

    Every Python stage holds the GIL, so a thread per stage buys no parallelism, only
    switches; chains keep a batch in one thread from the source to the model, and from the
    model's dispatcher thread to the sink. A step downstream of a model with several
    instances gets its own task, since those dispatchers run concurrently.
    """
    task_of: dict[str, str] = {}
    for sid, node in nodes.items():
        task_of[sid] = sid
        if node.kind not in CHAINABLE or len(node.inputs) != 1:
            continue
        up, port = split_ref(node.inputs[0])
        up_node = nodes[up]
        single = len(consumers[(up, port)]) == 1
        after_model = up_node.kind == "llm" or (
            up_node.kind == "infer" and up_node.spec.batcher.instances == 1
        )
        if single and (up_node.kind in CHAIN_UPSTREAM or after_model):
            task_of[sid] = task_of[up]
    return task_of


def thread_of(
    nodes: Mapping[str, Node], task_of: Mapping[str, str], inline: Collection[str] = ()
) -> dict[str, str]:
    """Step id -> the thread (group) that does its work: its task's, except that a model's
    calls, and the steps chained after it, run on the model's dispatcher threads (named by
    the model step). A batch the model's queue would dispatch at once runs them in the thread
    that hands it over instead (``DynamicBatcher.feed``): for the model steps in ``inline``
    (most of whose calls ran so), that thread is named."""
    out: dict[str, str] = {}
    for sid, node in nodes.items():
        if node.kind == "infer" and sid in inline and task_of[sid] != sid:
            out[sid] = out[split_ref(node.inputs[0])[0]]  # the upstream task's thread
        elif node.kind in MODEL_KINDS or task_of[sid] == sid:
            out[sid] = sid
        else:
            up = split_ref(node.inputs[0])[0]
            out[sid] = up if nodes[up].kind in MODEL_KINDS and up not in inline else out[up]
    return out


def tasks(nodes: Mapping[str, Node], task_of: Mapping[str, str]) -> dict[str, list[str]]:
    """Task id -> the step ids it runs, in order."""
    out: dict[str, list[str]] = defaultdict(list)
    for sid in nodes:
        out[task_of[sid]].append(sid)
    return dict(out)
