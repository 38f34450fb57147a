"""Hostile input for the fuzz tests: a seed corpus of the defects once found by hand, and
Hypothesis strategies that mutate valid workload-F lines into every kind of malformed one.

Whether a line is valid is decided by the plain-Python reference (``workload.parse_valid``),
never by the engine under test.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable

from hypothesis import strategies as st

from benchmarks.workload import parse_valid

__all__ = [
    "HOSTILE_LINES",
    "ODD_VALID",
    "ODD_VALID_LINES",
    "event_line",
    "hostile_chunks",
    "hostile_line",
    "mixed_lines",
    "mutate",
]


def event_line(i: int, user: str | None = None, **extra: object) -> bytes:
    """A valid workload-F event line (no newline) with id ``i``."""
    ev = {
        "id": i,
        "user": user if user is not None else f"u{i % 97}",
        "amount": round(1.5 + (i % 13) * 0.25, 2),
        "ts": 1_700_000_000_000 + i,
        "f": [round(((i * 7 + k) % 19) / 10 - 0.9, 4) for k in range(16)],
        **extra,
    }
    return json.dumps(ev, separators=(",", ":")).encode()


_GOOD = event_line(7)
_BOM = b"\xef\xbb\xbf"

HOSTILE_LINES: dict[str, bytes] = {
    # the three defects that once lost whole runs
    "two_values": _GOOD + b"," + event_line(8),
    "two_values_space": _GOOD + b" " + event_line(8),
    "deep_extra_object": _GOOD[:-1] + b',"meta":' + b'{"a":' * 3000 + b"1" + b"}" * 3000 + b"}",
    "deep_extra_array": _GOOD[:-1] + b',"meta":' + b"[" * 3000 + b"]" * 3000 + b"}",
    "deep_object": b'{"a":' * 3000 + b"1" + b"}" * 3000,
    "deep_array": b"[" * 5000 + b"]" * 5000,
    "nested_150k": b"[" * 150_000,
    "blank": b"",
    "spaces": b"   ",
    "tab_cr": b"\t\r",
    # values split across lines, or none
    "head_of_value": _GOOD[:40],
    "tail_of_value": _GOOD[40:],
    "unclosed_string": b'{"id":1,"user":"}',
    "closing_string": b'","x":1}',
    "array_top": b"[1,2,3]",
    "string_top": b'"just a string"',
    "null_top": b"null",
    "number_top": b"42",
    # wrong values
    "big_int_id": _GOOD.replace(b'"id":7', b'"id":' + str(2**70).encode()),
    "float_id": _GOOD.replace(b'"id":7', b'"id":7.0'),
    "bool_id": _GOOD.replace(b'"id":7', b'"id":true'),
    "nan_amount": _GOOD.replace(b'"amount":3.25', b'"amount":NaN'),
    "inf_amount": _GOOD.replace(b'"amount":3.25', b'"amount":1e999'),
    "huge_int_amount": _GOOD.replace(b'"amount":3.25', b'"amount":1' + b"0" * 400),
    "string_amount": _GOOD.replace(b'"amount":3.25', b'"amount":"3.25"'),
    "short_f": _GOOD.replace(b'"f":[', b'"f":[1.0],"g":['),
    "long_f": _GOOD.replace(b'"f":[', b'"f":[1.0,'),
    "missing_user": _GOOD.replace(b'"user":"u7",', b""),
    "null_user": _GOOD.replace(b'"user":"u7"', b'"user":null'),
    "dup_key_bad_first": _GOOD.replace(b'"id":7', b'"id":"x","id":7'),
    # bytes that are not JSON text
    "lone_surrogate": _GOOD.replace(b'"user":"u7"', b'"user":"\\ud800"'),
    "invalid_utf8": _GOOD.replace(b'"user":"u7"', b'"user":"\xff\xfe"'),
    "nul": b"\x00",
    "control_char": _GOOD.replace(b'"user":"u7"', b'"user":"a\x01b"'),
    "bom_inside": _BOM + _GOOD,
    "trailing_comma": _GOOD[:-1] + b",}",
    "comment": _GOOD + b" // note",
    "utf16": json.dumps({"id": 1}).encode("utf-16-le"),
}
"""Malformed lines by kind; each must be dead-lettered with its line number, never crash a run."""

ODD_VALID: dict[str, Callable[[int], bytes]] = {
    "spaces_around": lambda i: b"  " + event_line(i) + b"\t ",
    "crlf": lambda i: event_line(i) + b"\r",
    "unicode_user": lambda i: event_line(i, user="ü—😀"),
    "escaped_user": lambda i: event_line(i, user='a"b\\c\n'),
    "nested_extra": lambda i: event_line(i, meta={"a": [[[{"b": [1, 2, {"c": None}]}]]]}),
    "dup_key_valid": lambda i: event_line(i).replace(b'"id":', b'"id":99,"id":', 1),
    "int_amount": lambda i: event_line(i).replace(b'"amount":', b'"amount":3,"x":', 1),
    "long_extra": lambda i: event_line(i, pad="x" * 100_000),
}
"""Valid lines of unusual shape, by the id they get: each must come out once, like any other."""
ODD_VALID_LINES = {kind: make(100 + n) for n, (kind, make) in enumerate(ODD_VALID.items())}


def hostile_line(rng: random.Random, i: int) -> bytes:
    """A malformed line: a corpus entry, or a random mutation of a valid one (checked invalid)."""
    while True:
        corpus = rng.random() < 0.5
        line = rng.choice(list(HOSTILE_LINES.values())) if corpus else mutate(rng, event_line(i))
        if parse_valid(line) is None:
            return line


def mutate(rng: random.Random, line: bytes) -> bytes:
    """One random damage: a cut, a flipped or inserted byte, a deleted slice, a doubled value
    (never a newline: that would make two lines)."""
    return _damage(rng, line).replace(b"\n", b"")


def _damage(rng: random.Random, line: bytes) -> bytes:
    kind = rng.randrange(6)
    pos = rng.randrange(len(line) + 1)
    if kind == 0:
        return line[:pos]
    if kind == 1:
        return line[:pos] + bytes([rng.randrange(256)]) + line[pos + 1 :]
    if kind == 2:
        return line[:pos] + bytes(rng.randrange(256) for _ in range(rng.randrange(1, 8))) + line[pos:]
    if kind == 3:
        return line[:pos] + line[pos + rng.randrange(1, 20) :]
    if kind == 4:
        return line + rng.choice([b",", b" ", b"", b"]", b"}"]) + line
    return line.replace(b'"amount":', b'"amount":' + rng.choice([b"[", b"{", b'"', b"-", b"1e"]), 1)


def mixed_lines(n: int, *, bad_every: int = 5, seed: int = 0) -> list[bytes]:
    """``n`` lines of valid events (some of odd shape) with a hostile line every ``bad_every``."""
    rng = random.Random(seed)
    odd = list(ODD_VALID.values())
    out = []
    for i in range(n):
        if i % bad_every == bad_every - 1:
            out.append(hostile_line(rng, i))
        elif i % 50 == 3:
            out.append(odd[(i // 50) % len(odd)](i))
        else:
            out.append(event_line(i))
    return out


@st.composite
def hostile_chunks(draw: st.DrawFn, max_lines: int = 40) -> list[bytes]:
    """Chunks of lines mixing valid events, corpus entries, mutations and arbitrary bytes."""
    n = draw(st.integers(1, max_lines))
    seed = draw(st.integers(0, 2**32 - 1))
    rng = random.Random(seed)
    lines = []
    for i in range(n):
        choice = draw(st.integers(0, 5))
        if choice == 0:
            lines.append(draw(st.sampled_from(list(HOSTILE_LINES.values()))))
        elif choice == 1:
            lines.append(draw(st.binary(max_size=60)).replace(b"\n", b""))
        elif choice == 2:
            lines.append(mutate(rng, event_line(i)))
        elif choice == 3:
            lines.append(draw(st.sampled_from(list(ODD_VALID_LINES.values()))))
        else:
            lines.append(event_line(i))
    return lines
