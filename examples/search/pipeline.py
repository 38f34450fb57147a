"""Search over a stream of documents: embedded as they come, indexed, and queried by the stream.

    rows {"op": "upsert" | "delete" | "query", "id", "text"}
      -> tokenise (TextTokenizer)
      -> embed (TextEncoder: all-MiniLM-L6-v2, int8 ONNX, dynamic batching; a text embedded
         before is taken from the response cache, in this process or in Redis)
      -> vector index (upserts and deletes by id; HNSW past 512 documents)
      -> route the query rows by topic (EmbeddingRouter) to a branch per topic, which ranks its
         own modules' documents first among near-equals (Rerank)
      -> query rows with their top 10 {"id", "text", "hits", "scores", "cached", "route", "route_score"}

Run it: ``aisp run examples/search/pipeline.py`` (the standard library's docstrings as documents,
with updates, deletes and queries), or ``--input OPS.jsonl`` (``python examples/search/corpus.py
OPS.jsonl`` writes one). With ``--checkpoint-dir`` a restart reads on from the checkpoint with the
index restored: nothing is embedded again. ``--param cache=redis://127.0.0.1:6379/0`` keeps the
embedding cache in Redis, shared by every run that names it; ``--param cache=none`` turns it off.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import msgspec
import numpy as np
import pyarrow as pa

from aisp import BatcherConfig, NullSink, OnnxRuntime, Pipeline, TestingSource
from aisp.batch import Batch
from aisp.infer.cache.response import ResponseCache
from aisp.infer.runtimes.text_encoder import TextEncoder, packaged_minilm
from aisp.transform.text.router import EmbeddingRouter
from aisp.transform.text.tokenize import TextTokenizer
from aisp.transform.text.vectors import VectorIndex

HERE = Path(__file__).resolve().parent
OUTPUT_COLUMNS = ["id", "text", "hits", "scores", "cached", "route", "route_score"]

TOPICS = {
    "files": ["read a file", "list the files in a directory", "copy a file", "a path on disk"],
    "text": ["match a regular expression", "format a string", "split text into words", "unicode characters"],
    "network": ["open a socket connection", "send an http request", "parse a url", "send an email"],
    "concurrency": ["start a thread", "run tasks concurrently", "a lock between threads", "an event loop"],
    "data": ["serialize to json", "compress bytes", "hash some data", "a csv table"],
}
"""The topics queries are routed by, each with a few example phrasings."""

TOPIC_MODULES = {
    "files": ("os", "pathlib", "shutil", "glob", "fnmatch", "tempfile", "io", "zipfile", "tarfile"),
    "text": ("re", "string", "textwrap", "difflib", "unicodedata", "codecs", "locale", "gettext"),
    "network": ("socket", "selectors", "urllib.parse", "http.client", "email.message", "smtplib",
                "ftplib", "ipaddress", "mimetypes"),
    "concurrency": ("threading", "asyncio", "subprocess", "queue", "signal"),
    "data": ("json", "csv", "sqlite3", "pickle", "struct", "base64", "binascii", "gzip", "bz2", "lzma",
             "zlib", "hashlib", "hmac"),
}  # fmt: skip
"""Each topic's own modules: its branch ranks their documents first among near-equals."""
BOOST = 0.05


class Row(msgspec.Struct):
    """One input row: an upsert or delete of a document, or a query."""

    op: str
    id: str
    text: str = ""


def _corpus() -> object:
    spec = importlib.util.spec_from_file_location("aisp_example_search_corpus", HERE / "corpus.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def build(
    documents: int | str = 1500,
    queries: int | str = 200,
    exact_below: int | str = 512,
    backend: str = "usearch",
    cache: str = "local",
) -> Pipeline:
    """The search example; without ``--input`` its operations come from ``corpus.py``
    (``--param KEY=VALUE`` sets these arguments; ``exact_below`` large: exact search only;
    ``cache``: ``local``, ``none`` or a ``redis://`` URL)."""
    model, tokenizer_json = packaged_minilm()
    rows = _corpus().operations(int(documents), int(queries))  # type: ignore[attr-defined]
    p = Pipeline("search", output_columns=OUTPUT_COLUMNS)
    source = p.source("rows", TestingSource(rows, batch_rows=64), schema=Row)
    tokenizer = TextTokenizer(tokenizer_json, column="text")
    tokens = source.map_batch("tokenize", tokenizer)
    store = None if cache == "none" else ResponseCache(
        ["text"], ["embedding"], max_bytes=32 << 20, redis=None if cache == "local" else cache,
        namespace="aisp-search-embeddings",
    )  # fmt: skip
    encoder = TextEncoder(OnnxRuntime(model, name="minilm", intra_op_threads=1), cache=store)
    embedded = tokens.infer(
        "embed",
        encoder,
        inputs={n: n for n in ("input_ids", "attention_mask", "token_type_ids")},
        outputs={n: n for n in encoder.output_names},
        # two instances of one thread each (faster than one of two on small matrices); ordered:
        # results leave in the order the rows came, as the index applies rows in order
        batcher=BatcherConfig(max_batch_size=128, max_queue_delay_ms=5.0, instances=2, ordered=True),
        latency_budget_ms=50.0,
    )
    if store is None:  # every row marked as the cache would
        embedded = embedded.map_batch(
            "uncached", lambda b: b.with_columns({"cached": np.zeros(b.num_rows, dtype=bool)})
        )
    index = VectorIndex(dim=384, k=10, exact_below=int(exact_below), backend=backend)
    answered = embedded.vector_index("index", index)
    router = EmbeddingRouter.from_texts(TOPICS, tokenizer, TextEncoder(model), threshold=0.35)
    branches = router.attach(answered, "topic")
    ranked = [
        b.map_batch(f"rank.{name}", Rerank(TOPIC_MODULES.get(name, ()))) for name, b in branches.items()
    ]
    p.union("answers", *ranked).sink("out", NullSink())
    return p


class Rerank:
    """A topic branch's ranking: within each query's hits, documents of the topic's modules whose
    score is within ``BOOST`` of a better one move ahead of it (the hits stay the same set)."""

    def __init__(self, modules: tuple[str, ...]) -> None:
        self.modules = modules

    def __call__(self, batch: Batch) -> Batch:
        if not self.modules or not batch.num_rows:
            return batch
        hits, scores = batch.column("hits").to_pylist(), batch.column("scores").to_pylist()
        for i, (ids, sims) in enumerate(zip(hits, scores, strict=True)):
            boosted = [
                s + BOOST * (d.rsplit(".", 1)[0] in self.modules) for d, s in zip(ids, sims, strict=True)
            ]
            order = sorted(range(len(ids)), key=lambda j: -boosted[j])
            hits[i], scores[i] = [ids[j] for j in order], [sims[j] for j in order]
        columns = {
            "hits": pa.array(hits, batch.column("hits").type),
            "scores": pa.array(scores, batch.column("scores").type),
        }
        return batch.with_columns(columns)
