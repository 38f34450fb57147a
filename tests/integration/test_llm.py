"""The LLM step against real llama-cpp-python servers (SmolLM2-135M-Instruct): tokens as partial
rows then the answer, requests over several endpoints, retries before the first token (never
after), the breaker, deadlines and dead letters. Faults come from the fault proxy in front of
a real server. Generated text is checked by its properties, never by exact strings."""

from __future__ import annotations

import asyncio
import json
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from aisp import CollectSink, LlmSpec, OpenAIClient, Pipeline, TestingSource
from aisp.batch import PARTIAL, Batch
from aisp.faults.proxy import FaultProxy, Faults
from aisp.infer.llm.client import LlmError
from aisp.infer.llm.local import LocalLlama
from aisp.infer.llm.server import llama_server
from aisp.infer.llm.stage import LlmStage
from aisp.infer.runtimes.endpoints import BreakerConfig, RetryPolicy


@pytest.fixture(scope="module")
def servers() -> Iterator[list[str]]:
    with llama_server(threads=1) as a, llama_server(threads=1) as b:
        yield [a, b]


def port_of(url: str) -> int:
    return int(url.rsplit(":", 1)[1])


def generate(client: OpenAIClient, prompts: list[str], **spec: Any) -> tuple[list[dict[str, Any]], list[str]]:
    """What an LLM step emits for rows of ``prompts``, in order (partial rows flagged), and the
    reasons of the rows it dead-letters."""
    out: list[dict[str, Any]] = []
    dead: list[str] = []

    def emitted(batch: Batch) -> None:
        out.extend({**r, PARTIAL: PARTIAL in batch} for r in batch.rows())

    stage = LlmStage(
        LlmSpec(client=client, **spec), emit=emitted, emit_made=emitted,
        dead_letter=lambda batch, reason: dead.extend([reason] * batch.num_rows),
    )  # fmt: skip
    stage.feed(Batch.from_columns({"prompt": prompts, "n": list(range(len(prompts)))}))
    stage.close()
    return out, dead


def run(client: OpenAIClient, prompts: list[str], **spec: Any) -> tuple[list[dict[str, Any]], list[Any]]:
    """A pipeline's rows out of an LLM step on ``prompts`` (a sink takes whole rows) and its
    dead letters."""
    dead = Path(tempfile.mkdtemp()) / "dead.jsonl"
    p, out = Pipeline("llm"), CollectSink()
    src = p.source("q", TestingSource([{"prompt": q, "n": i} for i, q in enumerate(prompts)]))
    src.llm("gen", LlmSpec(client=client, **spec)).sink("out", out)
    p.run(dead_letter=str(dead))
    return out.rows, [json.loads(x) for x in dead.read_bytes().splitlines()]


def test_tokens_come_as_partial_rows_then_the_row_with_its_answer(servers: list[str]) -> None:
    client = OpenAIClient(servers[0], max_tokens=24, system="Answer in one short sentence.")
    rows, dead = generate(client, ["Paris is the capital of France. What is the capital of France?"])
    assert not dead
    *tokens, final = rows
    assert tokens and all(r[PARTIAL] and set(r) == {"token", "_id", "_ingest_ns", PARTIAL} for r in tokens)
    assert not final[PARTIAL] and final["n"] == 0
    assert "".join(r["token"] for r in tokens) == final["answer"] and "paris" in final["answer"].lower()
    assert final["completion_tokens"] >= len(tokens) and final["finish_reason"] in ("stop", "length")
    assert 0 < final["queue_ms"] < final["ttft_ms"] and final["tokens_per_s"] > 0 and final["jitter"] >= 0
    assert final["endpoint"] == servers[0]


def test_requests_spread_over_endpoints_and_answers_only_without_tokens(servers: list[str]) -> None:
    client = OpenAIClient(servers, max_tokens=8)
    rows, dead = generate(client, [f"Count to {i}." for i in range(6)], tokens=False)
    assert not dead and len(rows) == 6 and not any(r[PARTIAL] for r in rows)
    assert sorted(r["n"] for r in rows) == list(range(6))
    assert {r["endpoint"] for r in rows} == set(servers)  # least outstanding first: both serve
    assert all(e["requests"] >= 1 and e["failures"] == 0 for e in client.endpoints())


def test_a_refused_endpoint_fails_over_before_the_first_token_and_its_breaker_opens(
    servers: list[str],
) -> None:
    with FaultProxy(("127.0.0.1", port_of(servers[0])), faults=Faults(refuse=True)) as proxy:
        down = f"http://127.0.0.1:{proxy.port}"
        client = OpenAIClient([down, servers[1]], max_tokens=6, breaker=BreakerConfig(failures=2, reset_s=60))
        rows, dead = run(client, [f"Say {w}." for w in ("yes", "no", "maybe", "hello")], tokens=False)
    assert not dead and len(rows) == 4 and {r["endpoint"] for r in rows} == {servers[1]}
    state = {e["url"]: e for e in client.endpoints()}
    assert state[down]["failures"] >= 2 and state[down]["state"] == "open"


def test_a_stream_cut_after_its_first_token_is_not_tried_again(servers: list[str]) -> None:
    with FaultProxy(("127.0.0.1", port_of(servers[0]))) as proxy:
        client = OpenAIClient([f"http://127.0.0.1:{proxy.port}"], max_tokens=64)
        got: list[str] = []

        def piece(text: str) -> None:
            got.append(text)
            if len(got) == 1:
                proxy.reset_connections()

        async def generate() -> None:
            try:
                await client.generate("Write a long story about a cat.", piece)
            finally:
                await client.aclose()

        with pytest.raises(LlmError) as info:
            asyncio.run(generate())
    assert info.value.tokens >= 1 and got
    assert client.endpoints()[0]["requests"] == 1  # one attempt: its reader had a token already


def test_no_first_token_in_time_is_tried_again_then_the_row_is_a_dead_letter(servers: list[str]) -> None:
    with FaultProxy(("127.0.0.1", port_of(servers[0])), faults=Faults(blackhole=True)) as proxy:
        client = OpenAIClient(
            f"http://127.0.0.1:{proxy.port}", first_token_timeout_s=0.3,
            retry=RetryPolicy(attempts=2, base_ms=10, max_ms=20), breaker=BreakerConfig(failures=10),
        )  # fmt: skip
        rows, dead = run(client, ["Hello?"])
    assert not rows and len(dead) == 1
    assert (
        dead[0]["step"] == "gen"
        and "timeout" in dead[0]["reason"]
        and "after 2 attempts" in dead[0]["reason"]
    )
    assert client.endpoints()[0]["requests"] == 2


def test_the_in_process_runtime_streams_the_same_way() -> None:
    local = LocalLlama(n_threads=1, max_tokens=24, system="Answer in one short sentence.")
    try:
        rows, dead = generate(local, ["Paris is the capital of France. What is the capital of France?"] * 2)
    finally:
        local.close()
    assert not dead
    finals = [r for r in rows if not r[PARTIAL]]
    assert len(finals) == 2 and all(
        "paris" in f["answer"].lower() and f["endpoint"] == "local" for f in finals
    )
    first = rows[: rows.index(finals[0])]  # one generation at a time: the first's tokens, then its row
    assert first and "".join(r["token"] for r in first) == finals[0]["answer"]


def test_the_in_process_runtime_never_sends_half_a_character() -> None:
    """SmolLM2's byte-level BPE splits these characters' bytes across tokens: fed one token at a
    time through the runtime's own decoding, each piece is whole text, and they join to the text."""
    from aisp.infer.llm.detok import TokenText

    local = LocalLlama(n_threads=1, max_tokens=8)
    try:
        for text in ("東京タワー 🙂👩\u200d👩\u200d👧 café naïve 𝔘nicode", "€100 — ½ ∑"):
            ids = list(local._llm.tokenize(text.encode(), add_bos=False))  # noqa: SLF001
            assert len(ids) < len(text.encode())  # some tokens hold several bytes ...
            assert any("\ufffd" in local._decode([i]) for i in ids)  # noqa: SLF001 ... some part of one
            detok = TokenText(local._decode)  # noqa: SLF001
            pieces = [detok.feed([i]) for i in ids] + [detok.end()]
            assert "".join(pieces) == text and not any("\ufffd" in p for p in pieces)
    finally:
        local.close()
