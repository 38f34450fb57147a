"""The RAG example's corpus: short passages written for it (offline), and questions whose answer
one passage holds, with a word the answer must contain.

``operations(repeat)``: the rows the example reads by default, in order: every passage upserted,
then the questions, each asked ``repeat`` times (the repeats are answered from the cache).

    python examples/rag/corpus.py PASSAGES.jsonl   # the passages as upsert rows, to post first
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

PASSAGES = {
    "france": "Paris is the capital and the largest city of France, on the river Seine.",
    "germany": "Berlin is the capital of Germany and its largest city.",
    "italy": "Rome is the capital of Italy; the Vatican City lies inside it.",
    "spain": "Madrid is the capital of Spain, in the middle of the Iberian peninsula.",
    "japan": "Tokyo is the capital of Japan and one of the largest cities in the world.",
    "canada": "Ottawa is the capital of Canada, in the province of Ontario.",
    "australia": "Canberra is the capital of Australia; Sydney is its largest city.",
    "egypt": "Cairo is the capital of Egypt, on the river Nile.",
    "mars": "Mars is called the Red Planet because iron oxide on its surface makes it look red.",
    "jupiter": "Jupiter is the largest planet of the solar system, a gas giant.",
    "sun": "The Sun is a star; light from it takes about eight minutes to reach the Earth.",
    "moon": "The Moon orbits the Earth about once every 27 days.",
    "water": "Water boils at 100 degrees Celsius at sea level and freezes at 0 degrees Celsius.",
    "everest": "Mount Everest, in the Himalayas, is the highest mountain on Earth above sea level.",
    "nile": "The Nile is a river in Africa, one of the longest rivers in the world.",
    "pacific": "The Pacific is the largest and deepest ocean on Earth.",
    "python": "Python is a programming language created by Guido van Rossum, first released in 1991.",
    "shakespeare": "William Shakespeare wrote the plays Hamlet, Macbeth and Romeo and Juliet.",
    "piano": "The piano is a musical instrument played with a keyboard of 88 keys.",
    "honey": "Bees make honey from the nectar of flowers.",
}
"""Passage id -> text."""

QUESTIONS = [
    ("What is the capital of France?", "paris"),
    ("What is the capital of Japan?", "tokyo"),
    ("Which planet is called the Red Planet?", "mars"),
    ("What is the largest planet of the solar system?", "jupiter"),
    ("Who wrote Hamlet?", "shakespeare"),
    ("What do bees make from nectar?", "honey"),
]
"""(question, a word its answer must contain, lower case)."""


def operations(repeat: int = 2) -> list[dict[str, Any]]:
    """Every passage upserted, then every question ``repeat`` times (ids ``q<i>`` / ``q<i>.<r>``)."""
    rows: list[dict[str, Any]] = [{"op": "upsert", "id": pid, "text": t} for pid, t in PASSAGES.items()]
    for r in range(repeat):
        rows += [
            {"op": "query", "id": f"q{i}" + (f".{r}" if r else ""), "text": q}
            for i, (q, _) in enumerate(QUESTIONS)
        ]
    return rows


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("output", type=Path)
    args = parser.parse_args()
    upserts = [r for r in operations(1) if r["op"] == "upsert"]
    args.output.write_text("".join(json.dumps(r) + "\n" for r in upserts))
