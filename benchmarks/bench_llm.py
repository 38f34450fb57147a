"""LLM streaming through AISP against calling the server directly: tokens/s, time to first token
(TTFT) p50/p99, inter-token gaps and jitter at 1, 4 and 16 concurrent streams.

The server: llama-cpp-python's OpenAI-compatible server on the packaged SmolLM2-135M-Instruct
(Q4_1 GGUF, one generation at a time, greedy), on one thread (``--threads``): on two cores the
other one runs the clients and AISP, so the comparison shows what AISP adds, not a server
starved of its core. Direct: ``N`` clients, each streaming one chat completion after another
(``stream: true``, server-sent events) straight from the server with an async httpx client, the
strongest simple baseline: nothing in the way. AISP: the same clients post the same prompts to
``aisp serve benchmarks/llm_pipeline.py`` (an LLM step and nothing else, letting up to 16
requests at a time through to the server, which queues them as it does the direct ones) and
read the token lines of the NDJSON response as they come. Every request is timed at the client:
TTFT from sending to the first piece of text, then the gaps between pieces; jitter is each
request's stdev/mean of its gaps, averaged. Direct and AISP alternate, ``--rounds`` each,
median per figure.

    python benchmarks/bench_llm.py [--streams 1,4,16 --requests-per-stream 4 --rounds 3 --max-tokens 32]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from tests.support.serving import aisp_serve, wait_http  # noqa: E402

QUESTIONS = [
    "What is the capital of France?", "Name three primary colors.", "Why is the sky blue?",
    "What is a prime number?", "Describe a cat in one sentence.", "How do plants make food?",
    "What is the largest ocean?", "Give a tip for writing clear code.",
]  # fmt: skip


async def _direct(
    http: httpx.AsyncClient, url: str, prompt: str, max_tokens: int
) -> tuple[float, list[float]]:
    body = {"messages": [{"role": "user", "content": prompt}], "stream": True, "max_tokens": max_tokens,
            "temperature": 0.0}  # fmt: skip
    t0 = time.perf_counter()
    times: list[float] = []
    async with http.stream("POST", f"{url}/v1/chat/completions", json=body) as r:
        async for line in r.aiter_lines():
            if not line.startswith("data:") or line.startswith("data: [DONE]"):
                continue
            choice = json.loads(line[5:])["choices"][0]
            if (choice.get("delta") or {}).get("content"):
                times.append(time.perf_counter())
    return t0, times


async def _aisp(
    http: httpx.AsyncClient, url: str, prompt: str, _max_tokens: int
) -> tuple[float, list[float]]:
    t0 = time.perf_counter()
    times: list[float] = []
    body = json.dumps({"id": "q", "prompt": prompt})
    async with http.stream("POST", f"{url}/v1/pipelines/llm/events", content=body) as r:
        async for line in r.aiter_lines():
            if line.startswith('{"token"'):
                times.append(time.perf_counter())
    return t0, times


async def _run(call: Any, url: str, streams: int, per_stream: int, max_tokens: int) -> dict[str, float]:
    ttft: list[float] = []
    gaps: list[float] = []
    jitter: list[float] = []
    tokens = 0

    async def client(k: int) -> None:
        nonlocal tokens
        async with httpx.AsyncClient(timeout=300) as http:
            for i in range(per_stream):
                t0, times = await call(http, url, QUESTIONS[(k + i) % len(QUESTIONS)], max_tokens)
                if not times:
                    continue
                ttft.append(times[0] - t0)
                g = np.diff(times)
                gaps.extend(g.tolist())
                if g.size >= 2 and g.mean() > 0:
                    jitter.append(float(g.std() / g.mean()))
                tokens += len(times)

    start = time.perf_counter()
    await asyncio.gather(*(client(k) for k in range(streams)))
    wall = time.perf_counter() - start
    return {
        "tokens_per_s": tokens / wall,
        "ttft_p50_ms": float(np.percentile(ttft, 50)) * 1000,
        "ttft_p99_ms": float(np.percentile(ttft, 99)) * 1000,
        "itl_p50_ms": float(np.percentile(gaps, 50)) * 1000,
        "itl_p99_ms": float(np.percentile(gaps, 99)) * 1000,
        "jitter": float(np.mean(jitter)),
        "requests": len(ttft),
    }


def main() -> int:
    from aisp.infer.llm.server import llama_server

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--streams", default="1,4,16")
    ap.add_argument("--requests-per-stream", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument(
        "--threads",
        type=int,
        default=1,
        help="the LLM server's threads (1: the other core runs the clients and AISP)",
    )
    ap.add_argument("--serve-args", default="", help="more arguments for aisp serve")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    out: dict[str, Any] = {"max_tokens": args.max_tokens, "rounds": args.rounds, "streams": {}}
    with llama_server(threads=args.threads) as llm:
        params = ("--param", f"llm={llm}", "--param", f"max_tokens={args.max_tokens}",
                  "--param", "concurrency=16", *args.serve_args.split())  # fmt: skip
        with aisp_serve(
            ROOT / "benchmarks" / "llm_pipeline.py", http=True, grpc=False, extra_args=params
        ) as (
            addresses,
            _,
        ):
            wait_http(addresses["http"])
            aisp_url = f"http://{addresses['http']}"
            asyncio.run(_run(_direct, llm, 1, 2, args.max_tokens))  # warm both paths
            asyncio.run(_run(_aisp, aisp_url, 1, 2, args.max_tokens))
            for n in (int(x) for x in args.streams.split(",")):
                runs: dict[str, list[dict[str, float]]] = {"direct": [], "aisp": []}
                per = max(args.requests_per_stream, 2) if n < 16 else 2
                for _ in range(args.rounds):
                    runs["direct"].append(asyncio.run(_run(_direct, llm, n, per, args.max_tokens)))
                    runs["aisp"].append(asyncio.run(_run(_aisp, aisp_url, n, per, args.max_tokens)))
                med = {k: {f: statistics.median(r[f] for r in v) for f in v[0]} for k, v in runs.items()}
                med["aisp_vs_direct"] = {
                    "ttft_p99_added_ms": med["aisp"]["ttft_p99_ms"] - med["direct"]["ttft_p99_ms"],
                    "ttft_p50_added_ms": med["aisp"]["ttft_p50_ms"] - med["direct"]["ttft_p50_ms"],
                    "jitter_ratio": med["aisp"]["jitter"] / med["direct"]["jitter"],
                    "tokens_per_s_ratio": med["aisp"]["tokens_per_s"] / med["direct"]["tokens_per_s"],
                }
                out["streams"][n] = med
                print(json.dumps({n: med}, indent=1), flush=True)
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
