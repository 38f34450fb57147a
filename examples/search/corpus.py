"""The search example's corpus and its stream of operations, made offline from the Python
standard library's docstrings (their first paragraphs).

``documents(n)``: up to ``n`` (id, text) pairs, the id naming the documented object
(``module.name``). ``operations(n, queries, seed)``: the rows the example reads, in order:
every document upserted; then some documents updated (another document's text under their id)
and some deleted; then queries interleaved with a few more upserts, each query the text of a
document (so its best answer is known) or a question of its own.

    python examples/search/corpus.py OPS.jsonl [--documents 1500 --queries 200]
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import json
import random
import warnings
from pathlib import Path
from typing import Any

MODULES = [
    "os", "json", "re", "collections", "itertools", "functools", "pathlib", "typing", "asyncio",
    "threading", "subprocess", "shutil", "string", "textwrap", "datetime", "statistics", "random",
    "math", "heapq", "bisect", "csv", "sqlite3", "urllib.parse", "http.client", "email.message",
    "logging", "argparse", "inspect", "dataclasses", "enum", "decimal", "fractions", "zipfile",
    "tarfile", "hashlib", "hmac", "socket", "selectors", "queue", "contextlib", "abc", "io",
    "tempfile", "glob", "fnmatch", "pickle", "copy", "pprint", "difflib", "unicodedata", "locale",
    "gettext", "uuid", "calendar", "struct", "array", "operator", "weakref", "types", "ast", "dis",
    "tokenize", "codecs", "base64", "binascii", "gzip", "bz2", "lzma", "zlib", "configparser",
    "xml.etree.ElementTree", "html", "html.parser", "mimetypes", "smtplib", "ftplib", "ipaddress",
    "signal", "mmap", "platform", "sysconfig", "traceback", "warnings", "unittest", "doctest",
]  # fmt: skip

QUESTIONS = [
    "how do I read a file line by line", "sort a list in place", "current date and time",
    "compress data with gzip", "parse command line arguments", "match a regular expression",
    "run a shell command and capture its output", "make a temporary directory", "hash a password",
    "start a thread and wait for it", "open a network connection", "serialize objects to json",
]  # fmt: skip


def documents(n: int) -> list[tuple[str, str]]:
    """(id, text) of up to ``n`` public objects' docstrings, first paragraph, de-duplicated."""
    seen: set[str] = set()
    out: list[tuple[str, str]] = []
    for name in MODULES:
        with warnings.catch_warnings():  # some modules' members are deprecated aliases
            warnings.simplefilter("ignore")
            module = importlib.import_module(name)
            members = [(a, inspect.getdoc(o)) for a, o in sorted(inspect.getmembers(module)) if callable(o)]
        for attr, doc in members:
            if attr.startswith("_"):
                continue
            first = (doc or "").split("\n\n")[0].replace("\n", " ").strip()
            if len(first) > 20 and first not in seen:
                seen.add(first)
                out.append((f"{name}.{attr}", first))
                if len(out) >= n:
                    return out
    return out


def operations(n: int = 1500, queries: int = 200, seed: int = 0) -> list[dict[str, Any]]:
    """The example's input rows (see the module docstring)."""
    rng = random.Random(seed)
    docs = documents(n)
    rows: list[dict[str, Any]] = [{"op": "upsert", "id": i, "text": t} for i, t in docs]
    changed = rng.sample(range(len(docs)), len(docs) // 20)
    for a, b in zip(changed[::2], changed[1::2], strict=False):
        rows.append({"op": "upsert", "id": docs[a][0], "text": docs[b][1]})  # a now says what b says
        rows.append({"op": "delete", "id": docs[b][0], "text": ""})
    for q in range(queries):
        if q % 4 == 3:
            rows.append({"op": "query", "id": f"q{q}", "text": QUESTIONS[q % len(QUESTIONS)]})
        else:
            rows.append({"op": "query", "id": f"q{q}", "text": docs[rng.randrange(len(docs))][1]})
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--documents", type=int, default=1500)
    ap.add_argument("--queries", type=int, default=200)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    with args.out.open("w") as fh:
        for row in operations(args.documents, args.queries, args.seed):
            fh.write(json.dumps(row) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
