"""The pipeline ``bench_llm.py`` serves: each event's prompt through an LLM step, its tokens
streamed back to the client as they come, then the answer (nothing else in the way).

    aisp serve benchmarks/llm_pipeline.py --param llm=http://127.0.0.1:PORT --param max_tokens=32
"""

from __future__ import annotations

import msgspec

from aisp import LlmSpec, NullSink, OpenAIClient, Pipeline, TestingSource


class Prompt(msgspec.Struct):
    id: str
    prompt: str


def build(llm: str, max_tokens: int | str = 32, concurrency: int | str = 1) -> Pipeline:
    """``llm``: the server(s), comma-separated; ``concurrency``: streams at a time per server."""
    client = OpenAIClient(llm.split(","), max_tokens=int(max_tokens), concurrency=int(concurrency))
    p = Pipeline("llm", output_columns=["id", "answer", "completion_tokens"])
    source = p.source("prompts", TestingSource([]), schema=Prompt)
    source.llm("llm", LlmSpec(client=client)).sink("out", NullSink())
    return p
