"""Out-of-order events for the windows example, and the plain-Python reference it is checked
against.

    python examples/windows/events.py IN.jsonl --events 100000 [--seed 0] [--users 50]
    python examples/windows/events.py IN.jsonl --reference OUT.jsonl LATE.txt

Events are ``{"id", "user", "ts", "amount"}``; ``ts`` advances by about 20 ms an event, most
events come up to 3 s out of order, and about 1% come 5 to 40 s late (many of them miss their
window). The reference reads the lines in order and applies the example's rules one event at a
time, with dicts: no vectorisation, no batching.
"""

from __future__ import annotations

import argparse
import json
import random
from collections.abc import Iterable
from pathlib import Path
from typing import Any

SIZE_MS = 10_000
LATENESS_MS = 5_000
OUT_OF_ORDER_MS = 2_000
START_MS = 1_700_000_000_000


def make_events(n: int, seed: int = 0, users: int = 50) -> list[dict[str, Any]]:
    """``n`` events, deterministic for ``seed``."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        ts = (
            START_MS
            + 20 * i
            + rng.randint(0, 3_000)
            - (rng.randint(5_000, 40_000) if rng.random() < 0.01 else 0)
        )
        out.append(
            {
                "id": i,
                "user": f"u{rng.randrange(users)}",
                "ts": ts,
                "amount": round(rng.lognormvariate(3, 1), 2),
            }
        )
    return out


def reference(events: Iterable[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[int]]:
    """The example's rules, one event at a time: (window rows, ids of late events)."""
    open_windows: dict[tuple[str, int], dict[str, Any]] = {}
    done: list[dict[str, Any]] = []
    late: list[int] = []
    newest: int | None = None
    for e in events:
        watermark = None if newest is None else newest - OUT_OF_ORDER_MS
        if watermark is not None:  # windows the watermark has closed emit before this event
            closed = [k for k in open_windows if k[1] + SIZE_MS + LATENESS_MS <= watermark]
            done.extend(open_windows.pop(k) for k in closed)
        start = e["ts"] - e["ts"] % SIZE_MS
        if watermark is not None and start + SIZE_MS + LATENESS_MS <= watermark:
            late.append(e["id"])
        else:
            w = open_windows.setdefault(
                (e["user"], start),
                {
                    "user": e["user"],
                    "window_start": start,
                    "window_end": start + SIZE_MS,
                    "n": 0,
                    "sum": 0.0,
                    "max": float("-inf"),
                },
            )
            w["n"] += 1
            w["sum"] += e["amount"]
            w["max"] = max(w["max"], e["amount"])
        newest = e["ts"] if newest is None else max(newest, e["ts"])
    done.extend(open_windows.values())
    return done, late


def read_events(path: Path) -> list[dict[str, Any]]:
    """The well-formed events of a JSONL file (malformed lines are skipped, as they are dead letters)."""
    events = []
    for line in path.read_text().splitlines():
        try:
            e = json.loads(line)
        except ValueError:
            continue
        if isinstance(e, dict) and {"id", "user", "ts", "amount"} <= e.keys():
            events.append(e)
    return events


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("path", type=Path)
    parser.add_argument("--events", type=int, default=100_000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--users", type=int, default=50)
    parser.add_argument("--reference", nargs=2, type=Path, metavar=("OUT", "LATE"))
    args = parser.parse_args()
    if args.reference:
        rows, late = reference(read_events(args.path))
        args.reference[0].write_text("".join(json.dumps(r) + "\n" for r in rows))
        args.reference[1].write_text("".join(f"{i}\n" for i in late))
        return
    with args.path.open("w") as fh:
        for e in make_events(args.events, args.seed, args.users):
            fh.write(json.dumps(e, separators=(",", ":")) + "\n")


if __name__ == "__main__":
    main()
