"""Admission by a time-to-first-token target under three times an LLM's capacity: what clients
get with the target and without it.

The LLM: llama-cpp-python's server on the packaged SmolLM2-135M-Instruct (one generation at a
time, ``--threads``), behind ``aisp serve benchmarks/llm_pipeline.py`` (an LLM step, one stream
at a time to the server). First its capacity: requests one after another, the median time each
takes. Then an open-loop load at ``--load`` times that capacity for ``--seconds``, each request
a new prompt posted at its due time and read as it streams, once with ``--param ttft_ms=T`` and
once without a target. Per run: answered, refused (429 with Retry-After) and shed requests, the
TTFT of the answered ones (p50/p99/max, at the client, from sending) and how long refusals took.

    python benchmarks/bench_llm_admission.py [--target-ms 1500 --load 3 --seconds 10]
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from tests.support.serving import aisp_serve, wait_http  # noqa: E402


def ask(url: str, i: int) -> tuple[str, float, float]:
    """(outcome, TTFT or time to the refusal, Retry-After) of one request."""
    body = json.dumps({"id": f"r{i}", "prompt": f"Tell me one fact about the number {i}."})
    t0 = time.monotonic()
    with httpx.stream("POST", url, content=body, timeout=120) as r:
        if r.status_code == 429:
            r.read()
            return "refused", time.monotonic() - t0, float(r.headers.get("retry-after", 0))
        first = None
        for line in r.iter_lines():
            if first is None and line.startswith('{"token"'):
                first = time.monotonic() - t0
            if '"error"' in line:
                return "shed", time.monotonic() - t0, 0.0
    return "answered", first if first is not None else float("nan"), 0.0


def load(url: str, rate: float, seconds: float, offset: int) -> dict[str, Any]:
    results: list[tuple[str, float, float]] = []
    n = int(rate * seconds)
    threads = [threading.Thread(target=lambda i=i: results.append(ask(url, offset + i))) for i in range(n)]
    start = time.monotonic()
    for i, t in enumerate(threads):
        time.sleep(max(0.0, start + i / rate - time.monotonic()))
        t.start()
    for t in threads:
        t.join()
    answered = np.array([r[1] for r in results if r[0] == "answered"]) * 1000
    refused = np.array([r[1] for r in results if r[0] == "refused"]) * 1000
    out: dict[str, Any] = {
        "offered": n,
        "answered": int(answered.size),
        "refused": int(refused.size),
        "shed": sum(r[0] == "shed" for r in results),
    }
    if answered.size:
        p50, p99 = np.percentile(answered, [50, 99]).tolist()
        out.update(ttft_p50_ms=p50, ttft_p99_ms=p99, ttft_max_ms=float(answered.max()))
    if refused.size:
        out.update(refusal_p99_ms=float(np.percentile(refused, 99)))
    return out


def main() -> int:
    from aisp.infer.llm.server import llama_server

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target-ms", type=float, default=1500.0)
    ap.add_argument("--load", type=float, default=3.0, help="times the measured capacity")
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    out: dict[str, Any] = {"target_ms": args.target_ms, "load": args.load, "seconds": args.seconds}
    with llama_server(threads=args.threads) as llm:
        for target in (args.target_ms, None):
            params = ["--param", f"llm={llm}", "--param", f"max_tokens={args.max_tokens}"]
            params += ["--param", f"ttft_ms={target}"] if target else []
            with aisp_serve(ROOT / "benchmarks" / "llm_pipeline.py", http=True, grpc=False,
                            extra_args=tuple(params)) as (addresses, _):  # fmt: skip
                wait_http(addresses["http"])
                url = f"http://{addresses['http']}/v1/pipelines/llm/events"
                took = []
                for i in range(6):
                    t0 = time.monotonic()
                    ask(url, 10_000 + i)
                    took.append(time.monotonic() - t0)
                capacity = 1 / float(np.median(took[1:]))
                run = load(url, args.load * capacity, args.seconds, 20_000)
                run["capacity_per_s"] = capacity
                out["with_target" if target else "without_target"] = run
                print(json.dumps({"target_ms": target, **run}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
