"""Plain-Python baselines for workload F (fraud scoring), to put the engine's numbers in context.

- ``naive``: one event at a time: ``orjson.loads`` per line, dict-based running state, one
  ONNX Runtime call per event with a [1, 18] array, ``orjson.dumps`` per output line.
- ``hand``: the loop a competent user writes for a clean file, the baseline the engine is judged
  against: per chunk of 512 lines, ``orjson.loads`` per line into flat lists, users interned with
  ``dict.setdefault``, the exact running count and mean per user with numpy (rank levels), one
  ``float32[n, 18]`` feature matrix and one ONNX Runtime call, ``orjson.dumps`` per output row,
  one write per chunk. No validation: a bad line stops it with an exception.
- ``validating``: ``hand`` with the validity rules of ``benchmarks/workload.py``
  (a chunk is checked as a whole with numpy, line by line only when that check fails; invalid
  lines are counted and skipped), for files with bad lines.

All use one ORT thread and write the same output lines::

    {"id":0,"user":"u47318","score":0.0123,"alert":false,"n":1,"mean_amount":5.93}

``score`` is the float32 probability as a Python float, ``alert`` is ``score > 0.9``, ``n`` and
``mean_amount`` are the user's running count and mean amount counting this event.

Usage::

    python benchmarks/baselines.py {naive|hand|validating} --input F --output OUT \
        --model examples/fraud/model.onnx

prints one JSON line: ``{"name", "events", "invalid", "seconds", "events_per_s", "p99_ms",
"peak_rss_mb"}``. ``p99_ms`` is the per-event latency from the moment its line was read to the
moment its output line was written (``time.perf_counter_ns``); in ``hand`` and ``validating`` every
event of a chunk gets the time from the start of reading the chunk to the end of writing its outputs.
"""

from __future__ import annotations

import argparse
import itertools
import sys
from collections.abc import Callable, Iterable, Iterator
from itertools import chain
from operator import itemgetter
from pathlib import Path
from time import perf_counter_ns
from typing import Any

import numpy as np
import onnxruntime as ort
import orjson

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.workload import N_F, is_valid_event  # noqa: E402

ALERT_THRESHOLD = 0.9
DEFAULT_MODEL = Path(__file__).resolve().parent.parent / "examples" / "fraud" / "model.onnx"
_NL = orjson.OPT_APPEND_NEWLINE


def make_session(model_path: str | Path) -> ort.InferenceSession:
    """An ORT CPU session on one thread (intra and inter op), sequential execution."""
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 1
    opts.inter_op_num_threads = 1
    opts.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    return ort.InferenceSession(str(model_path), opts, providers=["CPUExecutionProvider"])


is_valid = is_valid_event


def _peak_rss_mb() -> float:
    try:
        import resource

        return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0, 1)
    except ImportError:  # not on Linux/macOS: current RSS is the best psutil offers
        import psutil

        return round(float(psutil.Process().memory_info().rss) / 2**20, 1)


def _result(name: str, events: int, invalid: int, elapsed_ns: int, lat_ns: np.ndarray) -> dict[str, Any]:
    secs = elapsed_ns / 1e9
    return {
        "name": name,
        "events": events,
        "invalid": invalid,
        "seconds": round(secs, 3),
        "events_per_s": round(events / secs, 1) if secs > 0 else 0.0,
        "p99_ms": round(float(np.percentile(lat_ns, 99)) / 1e6, 3) if len(lat_ns) else 0.0,
        "peak_rss_mb": _peak_rss_mb(),
    }


def run_naive(input_path: str | Path, output_path: str | Path, model_path: str | Path) -> dict[str, Any]:
    """Per-event loop: parse, update state, score with a [1, 18] ORT call, write, per event."""
    sess = make_session(model_path)
    loads, dumps, run = orjson.loads, orjson.dumps, sess.run
    state: dict[str, list[Any]] = {}  # user -> [count (int), sum of amounts (float)]
    lat: list[int] = []
    invalid = 0
    t_start = perf_counter_ns()
    with open(input_path, "rb") as fin, open(output_path, "wb") as fout:
        for raw in fin:
            t0 = perf_counter_ns()
            try:
                ev = loads(raw)
            except orjson.JSONDecodeError:
                invalid += 1
                continue
            if not is_valid(ev):
                invalid += 1
                continue
            user = ev["user"]
            st = state.get(user)
            if st is None:
                st = state[user] = [0, 0.0]
            st[0] += 1
            st[1] += ev["amount"]
            n = st[0]
            mean = st[1] / n
            row = np.array([[*ev["f"], n, mean]], dtype=np.float32)
            score = float(run(["score"], {"features": row})[0][0, 0])
            out = {
                "id": ev["id"],
                "user": user,
                "score": score,
                "alert": score > ALERT_THRESHOLD,
                "n": n,
                "mean_amount": mean,
            }
            fout.write(dumps(out, option=_NL))
            lat.append(perf_counter_ns() - t0)
    elapsed = perf_counter_ns() - t_start
    return _result("naive", len(lat), invalid, elapsed, np.asarray(lat, dtype=np.int64))


def _chunks(lines: Iterable[bytes], size: int) -> Iterator[tuple[int, list[bytes]]]:
    it = iter(lines)
    while True:
        t0 = perf_counter_ns()
        chunk = list(itertools.islice(it, size))
        if not chunk:
            return
        yield t0, chunk


class _UserState:
    """Per-user running count and sum, indexed by interned user id; grows by doubling."""

    def __init__(self) -> None:
        self.ids: dict[str, int] = {}
        self.count = np.zeros(1024, dtype=np.int64)
        self.total = np.zeros(1024, dtype=np.float64)

    def grow(self) -> None:
        size = len(self.count)
        if len(self.ids) > size:
            cap = max(len(self.ids), 2 * size)
            self.count = np.concatenate([self.count, np.zeros(cap - size, dtype=np.int64)])
            self.total = np.concatenate([self.total, np.zeros(cap - size, dtype=np.float64)])

    def update(self, uid: np.ndarray, amount: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Each event's running count and mean, exactly as a per-event loop in input order.

        An event's rank among its user's events in the chunk comes from a stable argsort; the
        state is then updated one rank level at a time (a user appears at most once per level,
        so a fancy-indexed ``+=`` is exact and adds in input order).
        """
        k = len(uid)
        order = np.argsort(uid, kind="stable")
        su = uid[order]
        first = np.empty(k, dtype=bool)
        first[0] = True
        np.not_equal(su[1:], su[:-1], out=first[1:])
        starts = np.flatnonzero(first)
        rank = np.empty(k, dtype=np.int64)
        rank[order] = np.arange(k) - np.repeat(starts, np.diff(np.append(starts, k)))
        n = np.empty(k, dtype=np.int64)
        s = np.empty(k, dtype=np.float64)
        count, total = self.count, self.total
        if len(starts) == k:  # every user once in this chunk: one level
            count[uid] += 1
            total[uid] += amount
            n[:] = count[uid]
            s[:] = total[uid]
        else:
            by_rank = np.argsort(rank, kind="stable")
            bounds = np.cumsum(np.bincount(rank))
            lo = 0
            for hi in bounds.tolist():
                ix = by_rank[lo:hi]
                u = uid[ix]
                count[u] += 1
                total[u] += amount[ix]
                n[ix] = count[u]
                s[ix] = total[u]
                lo = hi
        return n, s / n


_Rows = tuple[list[int], list[str], list[float], np.ndarray]
_FIELDS = itemgetter("id", "user", "amount", "ts", "f")


def _parse_fast(lines: list[bytes]) -> _Rows | None:
    """A chunk parsed with no check per event, then checked as a whole with numpy; None if
    any line may be invalid (the chunk then takes ``_parse_exact``)."""
    try:
        ids, users, amounts, tss, fs = zip(*map(_FIELDS, map(orjson.loads, lines)), strict=True)
        lens = set(map(len, fs))
        flat = list(chain.from_iterable(fs))
    except (orjson.JSONDecodeError, KeyError, TypeError, ValueError):
        return None
    joined = b"".join(lines)
    if b"true" in joined or b"false" in joined:  # numpy would take booleans as numbers
        return None
    try:
        id_arr, ts_arr, a_arr, feats = np.array(ids), np.array(tss), np.array(amounts), np.array(flat)
    except (ValueError, TypeError, OverflowError):
        return None
    if (
        id_arr.dtype != np.int64
        or ts_arr.dtype != np.int64
        or a_arr.dtype.kind not in "fi"
        or feats.dtype.kind not in "fi"
        or lens != {N_F}
        or set(map(type, users)) != {str}
        or not np.isfinite(a_arr).all()
        or not np.isfinite(feats).all()
    ):
        return None
    return list(ids), list(users), list(amounts), feats.reshape(len(ids), N_F)


def _parse_exact(lines: list[bytes]) -> tuple[_Rows, int]:
    """A chunk parsed with every validity rule checked per event (``is_valid``): its valid
    rows, and how many lines were invalid."""
    ids: list[int] = []
    users: list[str] = []
    amounts: list[float] = []
    fs: list[list[Any]] = []
    invalid = 0
    for raw in lines:
        try:
            ev = orjson.loads(raw)
        except orjson.JSONDecodeError:
            invalid += 1
            continue
        if is_valid(ev):
            ids.append(ev["id"])
            users.append(ev["user"])
            amounts.append(ev["amount"])
            fs.append(ev["f"])
        else:
            invalid += 1
    feats = np.array(fs, dtype=np.float64).reshape(len(ids), N_F)
    return (ids, users, amounts, feats), invalid


def _scored(
    run: Callable[..., Any], ids: Any, users: Any, feats: Any, n: np.ndarray, mean: np.ndarray
) -> bytes:
    """A chunk's output lines: ``float32[k, 18]`` features (the 16 given, the count and mean),
    one ORT call, ``orjson.dumps`` per row."""
    x = np.empty((len(ids), N_F + 2), dtype=np.float32)
    x[:, :N_F] = feats
    x[:, N_F] = n
    x[:, N_F + 1] = mean
    score = run(["score"], {"features": x})[0][:, 0]
    dumps = orjson.dumps
    return b"".join(
        [
            dumps({"id": i, "user": u, "score": s, "alert": al, "n": c, "mean_amount": m}, option=_NL)
            for i, u, s, al, c, m in zip(
                ids,
                users,
                score.tolist(),
                (score > ALERT_THRESHOLD).tolist(),
                n.tolist(),
                mean.tolist(),
                strict=True,
            )
        ]
    )


def run_validating(
    input_path: str | Path, output_path: str | Path, model_path: str | Path, chunk_size: int = 512
) -> dict[str, Any]:
    """The hand loop with the validity rules: per chunk of lines, parse into flat lists (checked
    as a whole, line by line when that fails), numpy state update, one [k, 18] ORT call,
    ``orjson.dumps`` per output row, one write."""
    sess = make_session(model_path)
    run = sess.run
    state = _UserState()
    table = state.ids
    lookup, intern = table.get, table.setdefault
    lat_chunks: list[tuple[int, int]] = []  # (latency ns, events)
    events = 0
    invalid = 0
    t_start = perf_counter_ns()
    with open(input_path, "rb") as fin, open(output_path, "wb") as fout:
        for t0, lines in _chunks(fin, chunk_size):
            rows = _parse_fast(lines)
            if rows is None:
                rows, bad = _parse_exact(lines)
                invalid += bad
            ids, users, amounts, feats = rows
            k = len(ids)
            if not k:
                continue
            uids = list(map(lookup, users))
            if None in uids:  # users not seen before get the next ids, in order of arrival
                uids = [intern(u, len(table)) if c is None else c for u, c in zip(users, uids, strict=True)]
            state.grow()
            n, mean = state.update(np.array(uids, dtype=np.int64), np.array(amounts, dtype=np.float64))
            fout.write(_scored(run, ids, users, feats, n, mean))
            lat_chunks.append((perf_counter_ns() - t0, k))
            events += k
    elapsed = perf_counter_ns() - t_start
    if lat_chunks:
        lat_arr = np.array(lat_chunks, dtype=np.int64)
        lat = np.repeat(lat_arr[:, 0], lat_arr[:, 1])
    else:
        lat = np.zeros(0, dtype=np.int64)
    return _result("validating", events, invalid, elapsed, lat)


def run_hand(
    input_path: str | Path, output_path: str | Path, model_path: str | Path, chunk_size: int = 512
) -> dict[str, Any]:
    """The hand loop for a clean file: ``run_validating`` without its validity checks."""
    sess = make_session(model_path)
    loads, run = orjson.loads, sess.run
    state = _UserState()
    table = state.ids
    intern = table.setdefault
    lat_chunks: list[tuple[int, int]] = []  # (latency ns, events)
    events = 0
    t_start = perf_counter_ns()
    with open(input_path, "rb") as fin, open(output_path, "wb") as fout:
        for t0, lines in _chunks(fin, chunk_size):
            ids, users, amounts, _, fs = zip(*map(_FIELDS, map(loads, lines)), strict=True)
            k = len(ids)
            uids = np.array([intern(u, len(table)) for u in users], dtype=np.int64)
            state.grow()
            n, mean = state.update(uids, np.array(amounts, dtype=np.float64))
            fout.write(_scored(run, ids, users, fs, n, mean))
            lat_chunks.append((perf_counter_ns() - t0, k))
            events += k
    elapsed = perf_counter_ns() - t_start
    lat_arr = np.array(lat_chunks or [(0, 0)], dtype=np.int64)
    return _result("hand", events, 0, elapsed, np.repeat(lat_arr[:, 0], lat_arr[:, 1]))


BASELINES: dict[str, Callable[[str | Path, str | Path, str | Path], dict[str, Any]]] = {
    "naive": run_naive,
    "hand": run_hand,
    "validating": run_validating,
}


def compare_outputs(
    path_a: str | Path, path_b: str | Path, score_tol: float = 1e-6, *, any_order: bool = False
) -> list[str]:
    """Differences between two output files (same lines up to float formatting); [] if equal.

    Scores may differ by ``score_tol`` (ORT's batch-1 and batched kernels may round differently);
    ``alert`` must agree unless the score is within ``score_tol`` of the threshold. With
    ``any_order`` the lines of ``path_b`` are compared in the order of their ids (several
    workers write each key's rows in order, but interleave keys); ``path_a`` is in id order.
    """
    problems: list[str] = []
    with open(path_a, "rb") as fa, open(path_b, "rb") as fb:
        lines_b: Iterable[bytes] = fb
        if any_order:
            lines_b = list(fb)
            ids = np.fromiter((orjson.loads(x)["id"] for x in lines_b), dtype=np.int64, count=len(lines_b))
            lines_b = [lines_b[i] for i in np.argsort(ids, kind="stable").tolist()]
        for i, (la, lb) in enumerate(itertools.zip_longest(fa, lines_b)):
            if la is None or lb is None:
                problems.append(f"line {i}: only in {'b' if la is None else 'a'}")
                break
            a, b = orjson.loads(la), orjson.loads(lb)
            if set(a) != set(b):
                problems.append(f"line {i}: keys {sorted(a)} != {sorted(b)}")
                continue
            for key in ("id", "user", "n"):
                if a[key] != b[key]:
                    problems.append(f"line {i}: {key} {a[key]!r} != {b[key]!r}")
            if a["mean_amount"] != b["mean_amount"]:
                problems.append(f"line {i}: mean_amount {a['mean_amount']!r} != {b['mean_amount']!r}")
            if abs(a["score"] - b["score"]) > score_tol:
                problems.append(f"line {i}: score {a['score']!r} != {b['score']!r}")
            near = abs(a["score"] - ALERT_THRESHOLD) <= score_tol
            if a["alert"] != b["alert"] and not near:
                problems.append(f"line {i}: alert {a['alert']!r} != {b['alert']!r}")
            if len(problems) >= 20:
                break
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Workload-F baselines (naive, hand, validating).")
    parser.add_argument("name", choices=sorted(BASELINES))
    parser.add_argument("--input", required=True, type=Path)
    parser.add_argument("--output", required=True, type=Path)
    parser.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    args = parser.parse_args(argv)
    result = BASELINES[args.name](args.input, args.output, args.model)
    sys.stdout.write(orjson.dumps(result, option=_NL).decode())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
