"""Workload F (fraud scoring): deterministic event generator and plain-Python reference.

Event lines (one JSON object per line, no spaces)::

    {"id":0,"user":"u47318","amount":5.93,"ts":1700000000000,"f":[16 floats]}

- ``id``: the line number (0-based), also for planted bad lines;
- ``user``: ``"u<N>"`` with N uniform over 100,000 users;
- ``amount``: lognormal(mean=3, sigma=1) rounded to cents (at least 0.01);
- ``ts``: epoch ms, ``1_700_000_000_000 + id // 4`` (non-decreasing);
- ``f``: 16 floats ~ N(0, 1) rounded to 4 decimals; ``f[1]`` is correlated with log(amount).
Every float is written with a decimal point (``6.0``, never ``6``).

The stream is prefix-stable: the first k events of a file of n >= k events do not depend on n
(each block of ``BLOCK`` events draws from its own ``default_rng([seed, block])``).

With ``bad_every=K > 0`` every K-th line (ids K-1, 2K-1, ...) is replaced by a malformed one,
cycling through ``BAD_KINDS``.

Validity rules (shared by the reference, the baselines and the engine): a line is valid iff it
is a JSON object with ``id`` an int (not bool) in int64 range, ``user`` a str, ``amount`` a
finite number (int or float, not bool), ``ts`` an int (not bool) in int64 range and ``f`` a
list of exactly 16 finite numbers (int or float, not bool). Extra keys are ignored. Running
state counts only valid events, in input order: ``n += 1; total += amount; mean = total / n``
(float64). The model input row is ``[*f, n, mean]`` as float32.

CLI: ``python benchmarks/workload.py OUT.jsonl --events N [--seed S] [--bad-every K]``
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

N_USERS = 100_000
N_F = 16
TS0 = 1_700_000_000_000
BLOCK = 65_536
ALERT_THRESHOLD = 0.9
BAD_KINDS = ("not_json", "missing_field", "wrong_type", "short_f", "non_finite", "float_id")
INT64_MIN = -(2**63)
INT64_MAX = 2**63 - 1


Piece = bytes | np.ndarray


def _digits(x: np.ndarray) -> np.ndarray:
    """Decimal digits of non-negative ints, right-aligned and NUL-padded: shape ``x.shape + (width,)``."""
    top = int(x.max()) if x.size else 0
    width = len(str(top))
    pw = 10 ** np.arange(width - 1, -1, -1, dtype=np.int64)
    d = (x[..., None] // pw) % 10 + 48
    significant = x[..., None] >= pw
    significant[..., -1] = True
    return np.where(significant, d, 0).astype(np.uint8)


def _frac_table(places: int) -> np.ndarray:
    """Row i: the digits of i/10**places after the point, trailing zeros cut ("0" for 0), NUL-padded."""
    texts = [(f"{i:0{places}d}".rstrip("0") or "0") for i in range(10**places)]
    return np.array(texts, dtype=f"S{places}").view(np.uint8).reshape(-1, places)


_FRAC2 = _frac_table(2)
_FRAC4 = _frac_table(4)
_F_SEP = np.frombuffer(b"," * (N_F - 1) + b"]", dtype=np.uint8)


def _fixed_point(k: np.ndarray, places: int, sep: np.ndarray | None = None) -> np.ndarray:
    """Text of k / 10**places the way Python's repr spells it ('-0.508', '6.0'), NUL-padded.

    Shape ``k.shape + (width,)``; ``sep`` (uint8 per last-axis position of ``k``) is appended.
    """
    scale = 10**places
    mag = np.abs(k)
    parts = [
        np.where(k < 0, ord("-"), 0).astype(np.uint8)[..., None],
        _digits(mag // scale),
        np.full((*k.shape, 1), ord("."), dtype=np.uint8),
        (_FRAC2 if places == 2 else _FRAC4)[mag % scale],
    ]
    if sep is not None:
        parts.append(np.broadcast_to(sep[:, None], (*k.shape, 1)))
    return np.concatenate(parts, axis=-1)


def _block_events(seed: int, block: int) -> dict[str, np.ndarray]:
    """One block of events; amounts in cents and f in units of 1e-4, as int64."""
    rng = np.random.default_rng([seed, block])
    user = rng.integers(0, N_USERS, size=BLOCK, dtype=np.int64)
    z_amount = rng.standard_normal(BLOCK)
    cents = np.maximum(np.rint(np.exp(3.0 + z_amount) * 100.0), 1.0).astype(np.int64)
    f = rng.standard_normal((BLOCK, N_F))
    f[:, 1] = 0.8 * z_amount + 0.6 * f[:, 1]
    return {"user": user, "cents": cents, "f_e4": np.rint(f * 1e4).astype(np.int64)}


def _render(pieces: list[Piece], n: int) -> tuple[np.ndarray, np.ndarray]:
    """Lay the pieces side by side in an (n, width) uint8 matrix, drop the NUL padding.

    Returns the bytes of all lines and the (n + 1) line offsets into them.
    """
    width = sum(len(p) if isinstance(p, bytes) else p.shape[1] for p in pieces)
    m = np.empty((n, width), dtype=np.uint8)
    col = 0
    for p in pieces:
        if isinstance(p, bytes):
            m[:, col : col + len(p)] = np.frombuffer(p, dtype=np.uint8)
            col += len(p)
        else:
            m[:, col : col + p.shape[1]] = p
            col += p.shape[1]
    keep = m != 0
    offsets = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(keep.sum(axis=1), out=offsets[1:])
    return m[keep], offsets


_RE_USER = re.compile(r'"user":"[^"]*",')
_RE_AMOUNT = re.compile(r'"amount":([^,]*),')
_RE_ID = re.compile(r'^\{"id":(-?\d+),')


def bad_line(kind: str, line: str) -> str:
    """Turn a good event line (with its trailing newline) into a malformed one of ``kind``."""
    if kind == "not_json":
        return line[: line.index(',"ts":') + 6] + "\n"
    if kind == "missing_field":
        return _RE_USER.sub("", line, count=1)
    if kind == "wrong_type":
        return _RE_AMOUNT.sub(r'"amount":"\1",', line, count=1)
    if kind == "short_f":
        return line.rsplit(",", 1)[0] + "]}\n"
    if kind == "non_finite":
        return _RE_AMOUNT.sub('"amount":1e999,', line, count=1)
    if kind == "float_id":
        return _RE_ID.sub(r'{"id":\1.0,', line, count=1)
    raise ValueError(f"unknown bad-line kind {kind!r}")


def _block_bytes(seed: int, block: int, start: int, stop: int, bad_every: int) -> list[bytes | np.ndarray]:
    """Text of events ``start..stop`` (all inside ``block``), as segments to write in order."""
    ev = _block_events(seed, block)
    lo, hi = start - block * BLOCK, stop - block * BLOCK
    n = hi - lo
    ids = np.arange(start, stop, dtype=np.int64)
    f_text = _fixed_point(ev["f_e4"][lo:hi], 4, _F_SEP)
    pieces: list[Piece] = [
        b'{"id":',
        _digits(ids),
        b',"user":"u',
        _digits(ev["user"][lo:hi]),
        b'","amount":',
        _fixed_point(ev["cents"][lo:hi], 2),
        b',"ts":',
        _digits(TS0 + ids // 4),
        b',"f":[',
        f_text.reshape(n, -1),
        b"}\n",
    ]
    data, offsets = _render(pieces, n)
    if bad_every <= 0:
        return [data]
    segments: list[bytes | np.ndarray] = []
    pos = 0
    for r in np.nonzero((ids + 1) % bad_every == 0)[0].tolist():
        ident = start + r
        kind = BAD_KINDS[((ident + 1) // bad_every - 1) % len(BAD_KINDS)]
        a, b = int(offsets[r]), int(offsets[r + 1])
        segments.append(data[pos:a])
        segments.append(bad_line(kind, data[a:b].tobytes().decode()).encode())
        pos = b
    segments.append(data[pos:])
    return segments


def write_events(path: str | Path, n: int, seed: int = 0, bad_every: int = 0) -> int:
    """Write ``n`` workload-F event lines to ``path``; return the number of bytes written.

    ``bad_every=K > 0`` replaces lines with ids K-1, 2K-1, ... by malformed ones, cycling through
    ``BAD_KINDS``.
    """
    if n < 0 or bad_every < 0:
        raise ValueError("n and bad_every must be >= 0")
    written = 0
    with open(path, "wb") as out:
        start = 0
        while start < n:
            block = start // BLOCK
            stop = min(n, (block + 1) * BLOCK)
            for seg in _block_bytes(seed, block, start, stop, bad_every):
                written += out.write(seg if isinstance(seg, bytes) else seg.data)
            start = stop
    return written


def event_lines(start: int, stop: int, seed: int = 0) -> list[bytes]:
    """Workload-F event lines with ids ``start..stop`` (each line as ``write_events`` writes it,
    without the newline): an endless stream made a block at a time."""
    out: list[bytes] = []
    while start < stop:
        block = start // BLOCK
        end = min(stop, (block + 1) * BLOCK)
        for seg in _block_bytes(seed, block, start, end, 0):
            out.extend((seg if isinstance(seg, bytes) else seg.tobytes()).split(b"\n")[:-1])
        start = end
    return out


# ----------------------------------------------------------------------------------------------
# plain-Python reference


def _is_int64(x: Any) -> bool:
    return type(x) is int and INT64_MIN <= x <= INT64_MAX


def _is_finite_number(x: Any) -> bool:
    if type(x) is float:
        return math.isfinite(x)
    if type(x) is int:
        try:
            return math.isfinite(float(x))
        except OverflowError:
            return False
    return False


def finite_numbers(values: list[Any]) -> bool:
    return all(_is_finite_number(v) for v in values)


def is_valid_event(ev: Any) -> bool:
    """The workload-F validity rules, checked exactly on a parsed event."""
    if type(ev) is not dict:
        return False
    f = ev.get("f")
    return (
        _INVALID not in ev.values()
        and _is_int64(ev.get("id"))
        and type(ev.get("user")) is str
        and _is_finite_number(ev.get("amount"))
        and _is_int64(ev.get("ts"))
        and type(f) is list
        and len(f) == N_F
        and finite_numbers(f)
    )


_INVALID = object()
_RULES = {
    "id": _is_int64,
    "user": lambda x: type(x) is str,
    "amount": _is_finite_number,
    "ts": _is_int64,
    "f": lambda x: type(x) is list and len(x) == N_F and finite_numbers(x),
}


def _fields(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """An object's keys; a field given twice takes its last value, and every value it was given
    must be valid (as the engine's decoder checks each occurrence)."""
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out and key in _RULES and not _RULES[key](out[key]):
            out[key] = _INVALID
            continue
        if out.get(key) is not _INVALID:
            out[key] = value
    return out


def _valid_unicode(ev: Any) -> bool:
    """No string anywhere in ``ev`` holds a lone surrogate (JSON escapes allow one; UTF-8 does not)."""
    stack = [ev]
    while stack:
        x = stack.pop()
        if type(x) is str:
            try:
                x.encode("utf-8")
            except UnicodeEncodeError:
                return False
        elif type(x) is dict:
            stack += x.keys()
            stack += x.values()
        elif type(x) is list:
            stack += x
    return True


def parse_valid(line: str | bytes) -> dict[str, Any] | None:
    """Parse one line with ``json.loads``; return the event if it is valid, else ``None``.

    The text must be UTF-8 and its strings valid Unicode; nesting past the interpreter's
    recursion limit makes a line invalid (the engine dead-letters it too).
    """
    try:
        text = line.decode("utf-8") if isinstance(line, bytes) else line
        ev = json.loads(text, object_pairs_hook=_fields)
    except (ValueError, RecursionError):
        return None
    return ev if is_valid_event(ev) and _valid_unicode(ev) else None


def reference_outputs(path: str | Path, model_path: str | Path) -> dict[int, dict[str, Any]]:
    """Expected output per valid event id: ``{"id", "user", "score", "alert", "n", "mean_amount"}``.

    Slow on purpose (json.loads and one ORT call per event): use it on small files.
    """
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 1
    opts.inter_op_num_threads = 1
    sess = ort.InferenceSession(str(model_path), opts, providers=["CPUExecutionProvider"])
    counts: dict[str, int] = {}
    totals: dict[str, float] = {}
    out: dict[int, dict[str, Any]] = {}
    with open(path, "rb") as fh:
        for raw in fh:
            ev = parse_valid(raw)
            if ev is None:
                continue
            user: str = ev["user"]
            n = counts.get(user, 0) + 1
            total = totals.get(user, 0.0) + float(ev["amount"])
            counts[user] = n
            totals[user] = total
            mean = total / n
            row = np.array([[*map(float, ev["f"]), float(n), mean]], dtype=np.float32)
            score = float(sess.run(["score"], {"features": row})[0][0, 0])
            out[ev["id"]] = {
                "id": ev["id"],
                "user": user,
                "score": score,
                "alert": score > ALERT_THRESHOLD,
                "n": n,
                "mean_amount": mean,
            }
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Write workload-F events as JSON lines.")
    parser.add_argument("out", type=Path)
    parser.add_argument("--events", type=int, required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--bad-every", type=int, default=0, help="plant a malformed line every K lines")
    args = parser.parse_args(argv)
    t0 = time.perf_counter_ns()
    nbytes = write_events(args.out, args.events, seed=args.seed, bad_every=args.bad_every)
    secs = (time.perf_counter_ns() - t0) / 1e9
    print(
        json.dumps(
            {"path": str(args.out), "events": args.events, "bytes": nbytes, "seconds": round(secs, 3)}
        ),
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())


def load_example(relative: str, name: str) -> Any:
    """An example's module, imported from its file (once)."""
    import importlib.util

    if name not in sys.modules:
        path = Path(__file__).resolve().parent.parent / "examples" / relative
        spec = importlib.util.spec_from_file_location(name, path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module  # msgspec resolves the schema's annotations through it
        spec.loader.exec_module(module)
    return sys.modules[name]


def load_fraud_example() -> Any:
    """The fraud example's pipeline module (``build``, ``Event``), imported from its file."""
    return load_example("fraud/pipeline.py", "aisp_example_fraud_pipeline")


def load_search_example(module: str = "pipeline") -> Any:
    """The search example's ``pipeline`` or ``corpus`` module, imported from its file."""
    return load_example(f"search/{module}.py", f"aisp_example_search_{module}")


def mlp_model(path: Path, *, width: int = 1024, seed: int = 0) -> Path:
    """A compute-heavy MLP (``features`` [batch, 18] -> width -> width -> ``score`` [batch, 1],
    random weights): milliseconds per call, so batching and queues matter. The diagnosis
    examples' ``write_mlp``."""
    scenario = load_example("diagnose/scenario.py", "aisp_example_diagnose_scenario")
    return scenario.write_mlp(path, width=width, seed=seed)  # type: ignore[no-any-return]
