"""The DAG a pipeline builds: nodes, edges, validation, topological order, static latency bound.

A ``Graph`` is plain data: each ``Node`` names its step id, its kind, the operator spec it runs,
the upstream ports it reads (``"step"`` or ``"step:port"``) and the output ports it offers.
``Graph.validate()`` rejects duplicate ids, unknown inputs, cycles and dangling outputs with a
``GraphError`` that names the step; ``topological_order()`` and ``latency_bound_ms()`` are
computed from the validated edges.
"""

from __future__ import annotations

from collections import defaultdict, deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from aisp.errors import GraphError

__all__ = ["DEFAULT_PORT", "Graph", "Node", "split_ref"]

DEFAULT_PORT = "out"
SOURCE_KINDS = frozenset({"source"})
SINK_KINDS = frozenset({"sink"})


def split_ref(ref: str) -> tuple[str, str]:
    """``"step:port"`` -> ``("step", "port")``; a bare ``"step"`` reads its default port."""
    step, _, port = ref.partition(":")
    return step, port or DEFAULT_PORT


@dataclass(frozen=True, kw_only=True)
class Node:
    """One step of the pipeline.

    Attributes:
        step_id: unique id, used in errors, metrics and dead letters.
        kind: ``source``, ``map_batch``, ``map``, ``filter``, ``key_by``, ``stateful``, ``infer``,
            ``llm``, ``route``, ``union`` or ``sink``.
        spec: the operator's configuration (turned into a runtime operator by the executor).
        inputs: upstream references, ``"step"`` or ``"step:port"``.
        ports: the output ports this node offers (sinks offer none).
        latency_budget_ms: the stage's share of the end-to-end latency budget.
        event_time: a source's ``EventTime`` (where its rows get event time and watermarks).
    """

    step_id: str
    kind: str
    spec: Any = None
    inputs: tuple[str, ...] = ()
    ports: tuple[str, ...] = (DEFAULT_PORT,)
    latency_budget_ms: float = 0.0
    event_time: Any = None


@dataclass
class Graph:
    """A validated-on-demand DAG of ``Node``s."""

    name: str
    nodes: list[Node] = field(default_factory=list)
    caches: dict[str, Any] = field(default_factory=dict)
    """Response caches in front of the graph's model steps (``aisp.infer.cache.response``), by step id."""
    rollouts: dict[str, Any] = field(default_factory=dict)
    """Model rollouts of the graph's rollout steps (``aisp.infer.models.rollout.Rollout``, with a
    ``status()``), by step id."""

    # -- construction -------------------------------------------------------------------------
    def add(self, node: Node) -> Node:
        if any(n.step_id == node.step_id for n in self.nodes):
            raise GraphError(f"duplicate step id {node.step_id!r}", step=node.step_id)
        if not node.step_id or ":" in node.step_id:
            raise GraphError(f"invalid step id {node.step_id!r}: non-empty, no ':'", step=node.step_id)
        self.nodes.append(node)
        return node

    def node(self, step_id: str) -> Node:
        for n in self.nodes:
            if n.step_id == step_id:
                return n
        raise GraphError(f"unknown step {step_id!r}", step=step_id)

    def replace(self, step_id: str, **changes: Any) -> None:
        """Swap fields of one node (e.g. bind a source or sink spec from the command line)."""
        from dataclasses import replace

        for i, n in enumerate(self.nodes):
            if n.step_id == step_id:
                self.nodes[i] = replace(n, **changes)
                return
        raise GraphError(f"unknown step {step_id!r}", step=step_id)

    # -- analysis -----------------------------------------------------------------------------
    def by_id(self) -> dict[str, Node]:
        return {n.step_id: n for n in self.nodes}

    def edges(self) -> list[tuple[str, str, str]]:
        """``(upstream, port, downstream)`` for every input reference."""
        return [(*split_ref(ref), n.step_id) for n in self.nodes for ref in n.inputs]

    def consumers(self) -> dict[tuple[str, str], list[str]]:
        out: dict[tuple[str, str], list[str]] = defaultdict(list)
        for up, port, down in self.edges():
            out[(up, port)].append(down)
        return out

    def validate(self) -> None:
        """Raise ``GraphError`` naming the step for the first problem found."""
        ids = self.by_id()
        if len(ids) != len(self.nodes):
            seen: set[str] = set()
            for n in self.nodes:
                if n.step_id in seen:
                    raise GraphError(f"duplicate step id {n.step_id!r}", step=n.step_id)
                seen.add(n.step_id)
        if not any(n.kind in SOURCE_KINDS for n in self.nodes):
            raise GraphError(f"pipeline {self.name!r} has no source")
        for n in self.nodes:
            self._check_arity(n)
            for ref in n.inputs:
                up, port = split_ref(ref)
                if up not in ids:
                    raise GraphError(f"step {n.step_id!r} reads unknown step {up!r}", step=n.step_id)
                if port not in ids[up].ports:
                    raise GraphError(
                        f"step {n.step_id!r} reads port {port!r} of {up!r}, which offers {ids[up].ports}",
                        step=n.step_id,
                    )
        self.topological_order()
        consumed = self.consumers()
        for n in self.nodes:
            for port in n.ports:
                if (n.step_id, port) not in consumed:
                    where = n.step_id if port == DEFAULT_PORT else f"{n.step_id}:{port}"
                    raise GraphError(
                        f"output {where!r} of step {n.step_id!r} goes nowhere; end it with .sink(...)",
                        step=n.step_id,
                    )

    @staticmethod
    def _check_arity(n: Node) -> None:
        if n.kind in SOURCE_KINDS and n.inputs:
            raise GraphError(f"source {n.step_id!r} cannot have inputs", step=n.step_id)
        if n.kind not in SOURCE_KINDS and not n.inputs:
            raise GraphError(f"step {n.step_id!r} has no input", step=n.step_id)
        if n.kind == "join" and len(n.inputs) != 2:
            raise GraphError(f"join {n.step_id!r} needs two inputs, got {len(n.inputs)}", step=n.step_id)
        if n.kind not in ("union", "join") and len(n.inputs) > 1:
            raise GraphError(f"step {n.step_id!r} has {len(n.inputs)} inputs; use union", step=n.step_id)

    def topological_order(self) -> list[Node]:
        """Kahn's algorithm; a cycle raises ``GraphError`` naming a step on it."""
        ids = self.by_id()
        indegree = {sid: 0 for sid in ids}
        children: dict[str, list[str]] = defaultdict(list)
        for up, _port, down in self.edges():
            if up in ids:
                indegree[down] += 1
                children[up].append(down)
        ready = deque(sid for sid in ids if indegree[sid] == 0)
        order: list[Node] = []
        while ready:
            sid = ready.popleft()
            order.append(ids[sid])
            for child in children[sid]:
                indegree[child] -= 1
                if indegree[child] == 0:
                    ready.append(child)
        if len(order) != len(ids):
            stuck = sorted(sid for sid, d in indegree.items() if d > 0)
            raise GraphError(f"cycle through step {stuck[0]!r} (steps on cycles: {stuck})", step=stuck[0])
        return order

    def latency_bound_ms(self) -> float:
        """Static end-to-end bound: the longest source-to-sink path of per-stage budgets."""
        best: dict[str, float] = {}
        for n in self.topological_order():
            ups = [best[split_ref(ref)[0]] for ref in n.inputs]
            best[n.step_id] = (max(ups) if ups else 0.0) + n.latency_budget_ms
        sinks = [best[n.step_id] for n in self.nodes if n.kind in SINK_KINDS]
        return max(sinks) if sinks else max(best.values(), default=0.0)

    def critical_path(self) -> list[str]:
        """The step ids on the path that sets ``latency_bound_ms``."""
        best: dict[str, tuple[float, list[str]]] = {}
        for n in self.topological_order():
            ups = [best[split_ref(ref)[0]] for ref in n.inputs]
            total, path = max(ups, key=lambda t: t[0]) if ups else (0.0, [])
            best[n.step_id] = (total + n.latency_budget_ms, [*path, n.step_id])
        ends = [best[n.step_id] for n in self.nodes if n.kind in SINK_KINDS] or list(best.values())
        return max(ends, key=lambda t: t[0])[1] if ends else []

    def render(self) -> str:
        """A plain-text listing of the DAG in topological order with budgets."""
        lines = [f"pipeline {self.name}"]
        for n in self.topological_order():
            src = ", ".join(n.inputs) if n.inputs else "-"
            budget = f"{n.latency_budget_ms:g} ms" if n.latency_budget_ms else "-"
            ports = "" if n.ports == (DEFAULT_PORT,) or not n.ports else f" ports={list(n.ports)}"
            lines.append(f"  {n.step_id:<16} {n.kind:<10} <- {src:<28} budget {budget}{ports}")
        path = " -> ".join(self.critical_path())
        lines.append(f"static end-to-end latency bound: {self.latency_bound_ms():g} ms ({path})")
        return "\n".join(lines)


def graph_from(name: str, nodes: Iterable[Node] | Sequence[Node] | Mapping[str, Node]) -> Graph:
    """Build a graph from nodes (handy in tests and config loaders)."""
    g = Graph(name)
    for n in nodes.values() if isinstance(nodes, Mapping) else nodes:
        g.add(n)
    return g
