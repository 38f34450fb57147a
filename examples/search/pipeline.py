"""Search over a stream of documents: embedded as they come, indexed, and queried by the stream.

    rows {"op": "upsert" | "delete" | "query", "id", "text"}
      -> tokenise (TextTokenizer) -> embed (TextEncoder: all-MiniLM-L6-v2, int8 ONNX, dynamic batching)
      -> vector index (upserts and deletes by id; HNSW past 512 documents)
      -> query rows with their top 10 {"id", "text", "hits", "scores"}

Run it: ``aisp run examples/search/pipeline.py`` (the standard library's docstrings as documents,
with updates, deletes and queries), or ``--input OPS.jsonl`` (``python examples/search/corpus.py
OPS.jsonl`` writes one). With ``--checkpoint-dir`` a restart reads on from the checkpoint with the
index restored: nothing is embedded again.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import msgspec

from aisp import BatcherConfig, NullSink, OnnxRuntime, Pipeline, TestingSource
from aisp.infer.text import TextEncoder, packaged_minilm
from aisp.transform.text import TextTokenizer
from aisp.transform.vectors import VectorIndex

HERE = Path(__file__).resolve().parent
OUTPUT_COLUMNS = ["id", "text", "hits", "scores"]


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
) -> Pipeline:
    """The search example; without ``--input`` its operations come from ``corpus.py``
    (``--param KEY=VALUE`` sets these arguments; ``exact_below`` large: exact search only)."""
    model, tokenizer = packaged_minilm()
    rows = _corpus().operations(int(documents), int(queries))  # type: ignore[attr-defined]
    p = Pipeline("search", output_columns=OUTPUT_COLUMNS)
    source = p.source("rows", TestingSource(rows, batch_rows=64), schema=Row)
    tokens = source.map_batch("tokenize", TextTokenizer(tokenizer, column="text"))
    embedded = tokens.infer(
        "embed",
        TextEncoder(OnnxRuntime(model, name="minilm", intra_op_threads=2)),
        inputs={n: n for n in ("input_ids", "attention_mask", "token_type_ids")},
        outputs={"embedding": "embedding"},
        # one instance: batches leave in the order they came, as the index applies rows in order
        batcher=BatcherConfig(max_batch_size=128, max_queue_delay_ms=5.0),
        latency_budget_ms=50.0,
    )
    index = VectorIndex(dim=384, k=10, exact_below=int(exact_below), backend=backend)
    embedded.vector_index("index", index).sink("out", NullSink())
    return p
