"""The pipeline ``bench_llm.py`` serves: each event's prompt through an LLM step, its tokens
streamed back to the client as they come, then the answer (nothing else in the way).

    aisp serve benchmarks/llm_pipeline.py --param llm=http://127.0.0.1:PORT --param max_tokens=32
"""

from __future__ import annotations

import msgspec

from aisp import LlmSlo, LlmSpec, NullSink, OpenAIClient, Pipeline, TestingSource


class Prompt(msgspec.Struct):
    id: str
    prompt: str


def build(llm: str, max_tokens: int | str = 32, concurrency: int | str = 1, ttft_ms: str = "") -> Pipeline:
    """``llm``: the server(s), comma-separated; ``concurrency``: streams at a time per server;
    ``ttft_ms``: a time-to-first-token target for admission."""
    client = OpenAIClient(llm.split(","), max_tokens=int(max_tokens), concurrency=int(concurrency))
    slo = LlmSlo(ttft_ms=float(ttft_ms)) if ttft_ms else LlmSlo()
    p = Pipeline("llm", output_columns=["id", "answer", "completion_tokens"])
    source = p.source("prompts", TestingSource([]), schema=Prompt)
    source.llm("llm", LlmSpec(client=client, slo=slo)).sink("out", NullSink())
    return p
