"""How a chaos run's output is judged against an uninterrupted run's: rows named by a key (one
field, or several comma-separated), lost, duplicated and with different values; floats equal to
1e-9 relative, since a sum over batches cut elsewhere rounds otherwise."""

from __future__ import annotations

import json
import math
from collections import Counter
from collections.abc import Sequence
from typing import Any

__all__ = ["compare", "row_name", "same", "without_dead_letters"]


def compare(reference: Sequence[bytes], outputs: Sequence[bytes], key: str) -> tuple[int, int, int]:
    """(lost, duplicates, wrong values) of ``outputs`` against ``reference`` (JSON lines), rows
    named by ``key``."""
    expected = {row_name(r, key): r for r in map(json.loads, reference)}
    rows = [json.loads(x) for x in outputs]
    counts = Counter(row_name(r, key) for r in rows)
    lost = sum(1 for k in expected if k not in counts)
    duplicates = sum(n - 1 for n in counts.values() if n > 1)
    wrong = sum(1 for r in rows if not same(expected.get(row_name(r, key)), r))
    return lost, duplicates, wrong


def row_name(row: dict[str, Any], key: str) -> Any:
    """The value of the field ``key`` in ``row``, or of the fields (comma-separated) as a tuple.

    >>> row_name({"user": "u1", "w": 3, "n": 2}, "user,w")
    ('u1', 3)
    """
    fields = key.split(",")
    return row[key] if len(fields) == 1 else tuple(row[f] for f in fields)


def same(a: Any, b: Any) -> bool:
    """Equal rows, floats to 1e-9 relative."""
    if isinstance(a, float) and isinstance(b, float):
        return math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-12)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(map(same, a, b))
    return bool(a == b)


def without_dead_letters(reference: Sequence[bytes], dead_letters: Sequence[bytes], key: str) -> list[bytes]:
    """The reference rows that no dead letter accounts for. A dead letter (``{"row": ...,
    "reason": ...}``) accounts for the output it would have been when its row carries the
    output's key (an event the fraud example would have scored); an input row of another shape (a
    late event a window step refused) never was an output, and the reference run refused it too."""
    fields = key.split(",")
    rows = [json.loads(x).get("row") for x in dead_letters if b'"row"' in x]
    dead = {row_name(r, key) for r in rows if isinstance(r, dict) and all(f in r for f in fields)}
    return [x for x in reference if row_name(json.loads(x), key) not in dead]
