"""The RAG example served: answers over its corpus with their sources, tokens streamed as they come
over HTTP (NDJSON and server-sent events), WebSocket and gRPC, repeated questions from the cache,
and admission by a time-to-first-token target at three times the LLM's capacity.

A real llama-cpp-python server (SmolLM2-135M-Instruct, greedy) answers; generated text differs
between builds, so the tests check properties of it (a word the passage holds), not strings.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import grpc
import httpx
import numpy as np
import pytest
from websockets.sync.client import connect

from aisp.infer.llm.server import llama_server
from aisp.observe.diagnose.pipeline import Scrape, diagnose
from tests.support.serving import aisp_serve, wait_http

ROOT = Path(__file__).resolve().parents[2]
PIPELINE = ROOT / "examples" / "rag" / "pipeline.py"
FRANCE = {"op": "query", "id": "q-fr", "text": "What is the capital of France?"}


def _corpus() -> Any:
    spec = importlib.util.spec_from_file_location("rag_corpus_tests", ROOT / "examples" / "rag" / "corpus.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


CORPUS = _corpus()


@pytest.fixture(scope="module")
def llm() -> Iterator[str]:
    with llama_server(threads=2) as url:
        yield url


@contextmanager
def rag(llm: str, *params: str) -> Iterator[dict[str, str]]:
    """The RAG example served on HTTP and gRPC, its index filled with the corpus."""
    args = ("--param", f"llm={llm}", *(x for p in params for x in ("--param", p)))
    with aisp_serve(PIPELINE, http=True, grpc=True, extra_args=args) as (addresses, _):
        wait_http(addresses["http"])
        upserts = b"".join(
            json.dumps(r).encode() + b"\n" for r in CORPUS.operations(1) if r["op"] == "upsert"
        )
        r = httpx.post(f"http://{addresses['http']}/v1/pipelines/rag/events", content=upserts, timeout=60)
        assert r.status_code == 200 and all("dropped" in json.loads(x) for x in r.content.splitlines())
        yield addresses


@pytest.fixture(scope="module")
def served(llm: str) -> Iterator[dict[str, str]]:
    with rag(llm) as addresses:
        yield addresses


def ask_http(
    address: str, question: dict[str, Any], *, sse: bool = False
) -> tuple[list[dict[str, Any]], int]:
    """The lines of the answer to ``question`` and how many pieces the body came in."""
    headers = {"accept": "text/event-stream"} if sse else {}
    pieces, body = 0, b""
    url = f"http://{address}/v1/pipelines/rag/events"
    with httpx.stream("POST", url, content=json.dumps(question), headers=headers, timeout=60) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"] == ("text/event-stream" if sse else "application/x-ndjson")
        for chunk in r.iter_raw():
            pieces += 1
            body += chunk
    if sse:
        events = [e for e in body.split(b"\n\n") if e]
        assert all(e.startswith(b"data: ") for e in events)
        return [json.loads(e[6:]) for e in events], pieces
    return [json.loads(x) for x in body.splitlines()], pieces


def check_streamed(lines: list[dict[str, Any]], word: str, source: str) -> dict[str, Any]:
    """Token lines, then the answer: the tokens make the answer, which holds ``word`` and names
    ``source`` first among its sources."""
    *tokens, final = lines
    assert tokens and all(set(t) == {"token"} for t in tokens)
    assert "".join(t["token"] for t in tokens) == final["answer"]
    assert word in final["answer"].lower()
    assert final["sources"][0] == source and len(final["sources"]) == 3
    assert final["cached"] is False and final["completion_tokens"] >= 1
    return final


def test_an_answer_streams_token_by_token_over_http_then_comes_with_its_sources(
    served: dict[str, str],
) -> None:
    lines, pieces = ask_http(served["http"], FRANCE)
    check_streamed(lines, "paris", "france")
    assert pieces >= 3  # the tokens came as they were made, not in one body at the end
    lines, pieces = ask_http(
        served["http"], {**FRANCE, "text": "Which planet is called the Red Planet?"}, sse=True
    )
    check_streamed(lines, "mars", "mars")
    assert pieces >= 3


def test_a_repeated_question_is_answered_from_the_cache(served: dict[str, str]) -> None:
    question = {"op": "query", "id": "q-jp", "text": "What is the capital of Japan?"}
    first, _ = ask_http(served["http"], question)
    answer = check_streamed(first, "tokyo", "japan")
    again, _ = ask_http(served["http"], question)
    assert len(again) == 1 and again[0]["cached"] is True and again[0]["answer"] == answer["answer"]


def test_websocket_and_grpc_clients_get_the_tokens_as_they_come(served: dict[str, str]) -> None:
    question = {"op": "query", "id": "q-hamlet", "text": "Who wrote Hamlet?"}
    with connect(f"ws://{served['http']}/v1/pipelines/rag/ws") as ws:
        ws.send(json.dumps(question))
        ws.send("")
        messages = list(ws)
    assert len(messages) >= 3  # tokens in messages of their own before the answer
    lines = [json.loads(x) for m in messages for x in str(m).splitlines()]
    check_streamed(lines, "shakespeare", "shakespeare")
    question = {"op": "query", "id": "q-bees", "text": "What do bees make from nectar?"}
    with grpc.insecure_channel(served["grpc"]) as channel:
        call = channel.stream_stream("/aisp.v1.Pipelines/Events")
        answers = list(call(iter([json.dumps(question).encode()]), timeout=60))
    assert len(answers) >= 3
    check_streamed([json.loads(x) for a in answers for x in a.splitlines()], "honey", "honey")


def timed(address: str, question: dict[str, Any]) -> tuple[float, float]:
    """(seconds to the first token line, seconds to the answer) of ``question`` asked alone."""
    t0 = time.monotonic()
    first = None
    url = f"http://{address}/v1/pipelines/rag/events"
    with httpx.stream("POST", url, content=json.dumps(question), timeout=60) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if first is None and "token" in json.loads(line):
                first = time.monotonic() - t0
    assert first is not None
    return first, time.monotonic() - t0


def test_at_three_times_capacity_admitted_requests_meet_the_ttft_target_and_the_rest_get_429(
    llm: str, served: dict[str, str]
) -> None:
    # What this machine does now (busy or not): one question at a time, each of its own (no cache
    # hits), through the served example without a target: its time to a first token and its
    # whole answer. The target allows a wait of about two of the slowest answers seen: a busy
    # machine's times vary by several times from one answer to the next.
    alone = [
        timed(served["http"], {**FRANCE, "id": f"m{i}", "text": f"{FRANCE['text']} <{i}>"}) for i in range(5)
    ]
    target_ms = round(1000 * 3 * max(ttft + answer for ttft, answer in alone))
    with rag(llm, f"ttft_ms={target_ms}", "max_tokens=32") as addresses:
        url = f"http://{addresses['http']}/v1/pipelines/rag/events"
        took = []  # the LLM's capacity, one question at a time, in the pipeline under test
        for i in range(4):
            took.append(
                timed(addresses["http"], {**FRANCE, "id": f"w{i}", "text": f"{FRANCE['text']} ({i})"})[1]
            )
        service_s = float(np.median(took))
        # offered at three times capacity, the queue grows by two answers for every three
        # questions: enough questions that it would reach twice the target by the last of them
        # (the target came from slower answers than this step's, so it is a dozen or more of
        # them: a fixed count of questions would not reach it on some machines)
        offered = 3 / service_s
        requests = max(24, math.ceil(3 * target_ms / 1000 / service_s))
        wait_s = 60 + 3 * target_ms / 1000
        results: list[tuple[str, float, float]] = []  # (outcome, ttft or refusal time, retry-after)
        channel = grpc.insecure_channel(addresses["grpc"])
        call = channel.stream_stream("/aisp.v1.Pipelines/Events")

        def one(i: int) -> None:
            question = {**FRANCE, "id": f"c{i}", "text": f"{FRANCE['text']} [{i}]"}
            t0 = time.monotonic()
            if i % 4 == 3:  # every fourth over gRPC
                try:
                    lines = []
                    for message in call(iter([json.dumps(question).encode()]), timeout=wait_s):
                        lines += [(time.monotonic() - t0, json.loads(x)) for x in message.splitlines()]
                except grpc.RpcError as exc:
                    assert exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                    results.append(("refused", time.monotonic() - t0, 1.0))
                    return
            else:
                with httpx.stream("POST", url, content=json.dumps(question), timeout=wait_s) as r:
                    if r.status_code == 429:
                        r.read()
                        results.append(("refused", time.monotonic() - t0, float(r.headers["retry-after"])))
                        return
                    lines = [(time.monotonic() - t0, json.loads(x)) for x in r.iter_lines()]
            if any("error" in row for _, row in lines):
                results.append(("shed", time.monotonic() - t0, 0.0))
            else:
                results.append(("answered", next(t for t, row in lines if "token" in row), 0.0))

        threads = [threading.Thread(target=one, args=(i,)) for i in range(requests)]
        start = time.monotonic()
        for i, t in enumerate(threads):
            time.sleep(max(0.0, start + i / offered - time.monotonic()))
            t.start()
        for t in threads:
            t.join(wait_s)
        channel.close()
        metrics = httpx.get(f"http://{addresses['http']}/metrics", timeout=10).text
    answered = [r[1] for r in results if r[0] == "answered"]
    refused = [r for r in results if r[0] == "refused"]
    assert len(results) == len(threads)
    assert answered and refused, (target_ms, service_s, requests, results)
    # the target holds for nearly all: a few may miss it by a little (the machine's speed changes
    # faster than the step's estimate, and a busy machine's answers vary by several times), none
    # by far. Without admission the queue would grow to twice the target by the last question:
    # about half the answers late, the last ones by up to twice the target.
    late = [t for t in answered if t * 1000 > target_ms]
    assert len(late) <= max(1, len(answered) // 4), (target_ms, sorted(answered))
    assert max(answered) * 1000 <= 1.5 * target_ms, (target_ms, sorted(answered))
    assert max(r[1] for r in refused) * 1000 < target_ms / 3  # at once, not after queueing
    assert all(r[2] > 0 for r in refused)  # with Retry-After
    shed = sum(r[0] == "shed" for r in results)
    assert shed <= len(results) // 10  # nearly all turned away before they started
    for family in ("aisp_llm_ttft_seconds_count", "aisp_llm_inter_token_seconds_count", "aisp_llm_jitter"):
        assert f'{family}{{stage="llm"}}' in metrics
    assert 'aisp_llm_requests_total{outcome="refused",stage="llm"}' in metrics
    assert f'aisp_llm_slo{{stage="llm",target="ttft_seconds"}} {target_ms / 1000}' in metrics
    queued = [line for line in metrics.splitlines() if line.startswith('aisp_llm_queued{stage="llm"}')]
    assert float(queued[0].split()[-1]) == 0.0  # nothing left waiting
    top = [f for f in diagnose(None, Scrape(metrics)) if f.cause.startswith("llm_")]
    assert top and top[0].stage == "llm" and top[0].cause == "llm_queueing"


def test_aisp_run_answers_the_built_in_questions_with_their_passages(llm: str, tmp_path: Path) -> None:
    out = tmp_path / "answers.jsonl"
    cmd = [sys.executable, "-m", "aisp.cli", "run", str(PIPELINE), "--output", str(out), "--no-live"]
    cmd += ["--param", f"llm={llm}", "--param", "repeat=1"]
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    subprocess.run(cmd, env=env, check=True, capture_output=True, timeout=300)
    rows = {r["id"]: r for r in map(json.loads, out.read_bytes().splitlines())}
    sources = {
        "q0": "france",
        "q1": "japan",
        "q2": "mars",
        "q3": "jupiter",
        "q4": "shakespeare",
        "q5": "honey",
    }
    assert sorted(rows) == sorted(sources)
    assert all(rows[q]["sources"][0] == s and rows[q]["answer"] for q, s in sources.items())
    said = [word in rows[f"q{i}"]["answer"].lower() for i, (_, word) in enumerate(CORPUS.QUESTIONS)]
    assert sum(said) >= len(said) - 1, rows  # a 135M model: the passage's word in (nearly) every answer
