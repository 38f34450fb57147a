"""Windowed aggregation: AISP's window step vs a hand-written chunked numpy loop and Bytewax's
``fold_window``, on the same file, in the same run (rounds alternate their order; median of 3).

The workload is the windows example's (``examples/windows/``): out-of-order JSON lines
``{"id", "user", "ts", "amount"}``, the watermark = the largest ``ts`` read so far - 2 s,
10 s tumbling windows per user with 5 s of allowed lateness, ``{n, sum, max}`` of ``amount``;
late events are counted apart. Every contender parses the JSON itself and must find the same
number of windows and late events (Bytewax's watermark is ``max ts - 7 s`` with the system
clock held still, which closes the same windows).

    python benchmarks/bench_windows.py [--events 5000000] [--users 100] [--rounds 3] [--skip bytewax]
    (Bytewax: pip install -e '.[bench]')
"""

from __future__ import annotations

import argparse
import importlib.util
import io
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.json as pj

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "windows"
SIZE, LATENESS, DELAY = 10_000, 5_000, 2_000


def _load(name: str, path: Path) -> Any:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


# -- AISP ---------------------------------------------------------------------------------------
def run_aisp(path: Path, batch_rows: int = 2048) -> tuple[int, int]:
    from aisp.connectors import source_for
    from aisp.schedule.config import ExecutorOptions

    p = _load("bench_windows_pipeline", EXAMPLE / "pipeline.py").build(events=1)
    p.bind(source=source_for(p, str(path)))  # the example's sink counts the windows, keeps none
    summary = p.run(execution=ExecutorOptions(source_batch_rows=batch_rows))
    return summary.events_out, summary.dead_letters


# -- a hand-written chunked numpy loop ----------------------------------------------------------
def run_numpy(path: Path, chunk_bytes: int = 1 << 21) -> tuple[int, int]:
    """What a competent numpy user writes: Arrow's JSON reader per chunk of lines, the per-row
    watermark from a running maximum, windows grouped with ``np.unique`` and reduced with
    ``bincount``/``maximum.at``; a dict of open windows by start, closed in whole buckets."""
    codes: dict[str, int] = {}
    open_by_start: dict[int, dict[int, list[float]]] = {}
    newest = np.iinfo(np.int64).min
    windows = late = 0
    with path.open("rb") as fh:
        while lines := fh.readlines(chunk_bytes):
            table = pj.read_json(io.BytesIO(b"".join(lines)))
            ts = table.column("ts").to_numpy()
            amount = table.column("amount").to_numpy().astype(np.float64, copy=False)
            users = table.column("user").combine_chunks().dictionary_encode()
            local = np.array([codes.setdefault(u, len(codes)) for u in users.dictionary.to_pylist()])
            user = local[users.indices.to_numpy()]
            before = np.empty_like(ts)
            before[0] = newest
            np.maximum.accumulate(ts[:-1], out=before[1:])
            np.maximum(before[1:], newest, out=before[1:])
            newest = max(newest, int(ts.max()))
            start = ts - ts % SIZE
            keep = ~((before != np.iinfo(np.int64).min) & (start + SIZE + LATENESS <= before - DELAY))
            late += int(np.count_nonzero(~keep))
            key = user[keep].astype(np.int64) << 32 | (
                start[keep] // SIZE - (start[keep].min() // SIZE if keep.any() else 0)
            )
            uniq, inv = np.unique(key, return_inverse=True)
            n = np.bincount(inv)
            s = np.bincount(inv, amount[keep])
            m = np.full(uniq.shape[0], -np.inf)
            np.maximum.at(m, inv, amount[keep])
            first = np.zeros(uniq.shape[0], dtype=np.int64)
            first[inv[::-1]] = np.arange(inv.shape[0])[::-1]
            starts = start[keep][first]
            for u, w, a, b, c in zip(
                (uniq >> 32).tolist(), starts.tolist(), n.tolist(), s.tolist(), m.tolist(), strict=True
            ):
                cur = open_by_start.setdefault(w, {}).get(u)
                if cur is None:
                    open_by_start[w][u] = [a, b, c]
                else:
                    cur[0] += a
                    cur[1] += b
                    cur[2] = max(cur[2], c)
            watermark = newest - DELAY
            for w in [w for w in open_by_start if w + SIZE + LATENESS <= watermark]:
                windows += len(open_by_start.pop(w))
    return windows + sum(len(v) for v in open_by_start.values()), late


# -- Bytewax ------------------------------------------------------------------------------------
def run_bytewax(path: Path) -> tuple[int, int]:
    import bytewax.operators as op
    import bytewax.operators.windowing as win
    import orjson
    from bytewax.connectors.files import FileSource
    from bytewax.dataflow import Dataflow
    from bytewax.testing import TestingSink, run_main

    still = datetime(2020, 1, 1, tzinfo=UTC)
    flow = Dataflow("windows")
    events = op.map("parse", op.input("in", flow, FileSource(path, batch_size=2048)), orjson.loads)
    keyed = op.key_on("user", events, lambda e: e["user"])
    clock = win.EventClock(
        lambda e: datetime.fromtimestamp(e["ts"] / 1000, tz=UTC),
        wait_for_system_duration=timedelta(milliseconds=DELAY + LATENESS),
        now_getter=lambda: still,  # replaying a file: the watermark follows the events only
    )
    windower = win.TumblingWindower(
        length=timedelta(milliseconds=SIZE), align_to=datetime(1970, 1, 1, tzinfo=UTC)
    )

    def fold(acc: list[float], e: dict[str, Any]) -> list[float]:
        return [acc[0] + 1, acc[1] + e["amount"], max(acc[2], e["amount"])]

    def merge(a: list[float], b: list[float]) -> list[float]:
        return [a[0] + b[0], a[1] + b[1], max(a[2], b[2])]

    out = win.fold_window(
        "agg", keyed, clock, windower, lambda: [0, 0.0, float("-inf")], fold, merge, ordered=False
    )
    done: list[Any] = []
    late: list[Any] = []
    op.output("out", out.down, TestingSink(done))
    op.output("late", out.late, TestingSink(late))
    run_main(flow)
    return len(done), len(late)


CONTENDERS: dict[str, Callable[[Path], tuple[int, int]]] = {
    "aisp": run_aisp,  # the default batch size (--batch-rows 2048)
    "aisp_batch8192": lambda path: run_aisp(path, 8192),
    "numpy_chunked": run_numpy,
    "bytewax": run_bytewax,
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--events", type=int, default=5_000_000)
    parser.add_argument("--users", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--skip", nargs="*", default=[], choices=list(CONTENDERS))
    parser.add_argument("--json", type=Path, help="Write the results here too.")
    args = parser.parse_args(argv)
    events = _load("bench_windows_events", EXAMPLE / "events.py")
    contenders = {k: v for k, v in CONTENDERS.items() if k not in args.skip}
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "events.jsonl"
        with path.open("w") as fh:
            for e in events.make_events(args.events, seed=1, users=args.users):
                fh.write(json.dumps(e, separators=(",", ":")) + "\n")
        rates: dict[str, list[float]] = {k: [] for k in contenders}
        results: dict[str, tuple[int, int]] = {}
        for r in range(args.rounds):
            order = list(contenders) if r % 2 == 0 else list(reversed(contenders))
            for name in order:
                t = time.perf_counter()
                results[name] = contenders[name](path)
                rates[name].append(args.events / (time.perf_counter() - t))
                rate = rates[name][-1]
                print(f"round {r + 1}: {name:<14} {rate:>12,.0f} events/s  (windows, late) = {results[name]}")
        exact = {k: v for k, v in results.items() if k != "bytewax"}
        if len(set(exact.values())) > 1:  # Bytewax's watermark moves per batch: its counts differ a little
            print(f"contenders disagree: {exact}")
            return 1
    command = ["python benchmarks/bench_windows.py", *(argv if argv is not None else sys.argv[1:])]
    report: dict[str, Any] = {
        "command": " ".join(command),
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
        "events": args.events, "users": args.users, "windows_and_late": results,
        "events_per_s_median": {k: statistics.median(v) for k, v in rates.items()},
    }  # fmt: skip
    for mine in ("aisp", "aisp_batch8192"):
        for other in rates.keys() - {"aisp", "aisp_batch8192"} if mine in rates else ():
            ratios = [a / b for a, b in zip(rates[mine], rates[other], strict=True)]
            report[f"{mine}_over_{other}_per_round_median"] = statistics.median(ratios)
    print(json.dumps(report, indent=2))
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
