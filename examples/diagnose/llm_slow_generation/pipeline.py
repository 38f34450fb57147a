"""Planted: an LLM step whose generation is slower than its budget. Each event asks the packaged
SmolLM2-135M (llama-cpp-python's OpenAI-compatible server on one CPU thread, one generation at a
time) for a note of up to 64 tokens, and the step has half a second for it. At one request every
four seconds nothing waits for the server (an answer takes about a second, two or three on a
busy machine): every answer is late because generating it is slow, and ``aisp diagnose`` names
``llm_slow_generation`` (a faster or smaller model, shorter answers), not ``llm_queueing``
(which more servers would fix).

    aisp run examples/diagnose/llm_slow_generation/pipeline.py --rate 0.25 --metrics-port 9464
"""

from __future__ import annotations

import atexit
from contextlib import ExitStack

from aisp import Batch, LlmSpec, NullSink, OpenAIClient, Pipeline, WorkloadFSource
from aisp.infer.llm.server import llama_server

RATE = 0.25
MAX_TOKENS = 64


def prompts(batch: Batch) -> Batch:
    users = batch.pylist("user")
    return batch.select(["id", "_id", "_ingest_ns"]).with_columns(
        {
            "prompt": [
                f"Write a friendly two-sentence note to customer {u} about their last payment." for u in users
            ]
        }
    )


def build(events: int = 10_000) -> Pipeline:
    stack = ExitStack()
    url = stack.enter_context(llama_server(threads=1))
    atexit.register(stack.close)
    client = OpenAIClient([url], max_tokens=MAX_TOKENS, name="llm:smollm2")
    p = Pipeline("llm_slow_generation", output_columns=["id", "answer"])
    asked = p.source("events", WorkloadFSource(events=int(events))).map_batch("prompt", prompts)
    asked.llm("llm", LlmSpec(client=client, prompt="prompt"), latency_budget_ms=500).sink("out", NullSink())
    return p
