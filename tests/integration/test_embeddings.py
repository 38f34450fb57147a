"""Sentence embeddings through the infer step (all-MiniLM-L6-v2, int8 ONNX, from packages):
single texts batched dynamically give each text the embedding the model gives it alone, mean
pooled and unit length, whatever the batch and the length-sorted chunks; similar sentences are
close and unrelated ones are not."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
from prometheus_client import CollectorRegistry, generate_latest

from aisp import BatcherConfig, CollectSink, Pipeline, TestingSource
from aisp.errors import ConfigError
from aisp.infer.runtimes.text_encoder import TextEncoder, packaged_minilm
from aisp.observe.export.metrics import PipelineCollector
from aisp.schedule.executor import LocalExecutor
from aisp.sinks.deadletter import DeadLetterSink
from aisp.transform.text.tokenize import TextTokenizer

MODEL, TOKENIZER = packaged_minilm()
INPUTS = {n: n for n in ("input_ids", "attention_mask", "token_type_ids")}
TEXTS = [
    "the capital of France is Paris",
    "Paris is the capital city of France",
    "a recipe for pancakes with maple syrup",
    "",
    "stream processing " * 80,  # truncated at 128 tokens
    "ok",
    "Ünïcödé, emoji 🙂 and CJK 漢字 text",
] * 6


def alone(text: str) -> np.ndarray:
    """The model on one text, no padding, mean pooled, unit length."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(TOKENIZER))
    tok.no_padding()
    tok.enable_truncation(128)
    e = tok.encode(text)
    pairs = (("input_ids", e.ids), ("attention_mask", e.attention_mask), ("token_type_ids", e.type_ids))
    feed = {k: np.array([v], dtype=np.int64) for k, v in pairs}
    hidden = ort.InferenceSession(str(MODEL)).run(["last_hidden_state"], feed)[0]
    v = (hidden * feed["attention_mask"][..., None]).sum(axis=1)[0] / len(e.ids)
    return v / np.linalg.norm(v)


@pytest.mark.parametrize("chunk_rows", [32, 3])
def test_single_texts_batched_get_the_embedding_the_model_gives_each_alone(chunk_rows: int) -> None:
    p = Pipeline("embed")
    out = CollectSink(columns=["id", "text", "embedding"])
    texts = p.source(
        "texts", TestingSource([{"id": i, "text": t} for i, t in enumerate(TEXTS)], batch_rows=1)
    )
    texts.map_batch("tokenize", TextTokenizer(TOKENIZER)).infer(
        "embed", TextEncoder(MODEL, name="minilm", chunk_rows=chunk_rows), inputs=INPUTS,
        outputs={"embedding": "embedding"}, batcher=BatcherConfig(max_batch_size=16, max_queue_delay_ms=5.0),
    ).sink("out", out)  # fmt: skip
    summary = p.run()
    assert sorted(r["id"] for r in out.rows) == list(range(len(TEXTS)))
    assert summary.models["embed"]["batches"] < len(TEXTS)  # batched, not one call per text
    got = {r["text"]: np.array(r["embedding"], dtype=np.float32) for r in out.rows}
    for text in set(TEXTS):
        assert got[text].shape == (384,)
        assert np.abs(got[text] - alone(text)).max() < 1e-5, text
    same, other = got[TEXTS[0]] @ got[TEXTS[1]], got[TEXTS[0]] @ got[TEXTS[2]]
    assert same > 0.9 and other < 0.3


def test_an_encoder_that_cannot_work_fails_where_it_is_declared() -> None:
    with pytest.raises(ConfigError, match="no output 'pooled'"):
        TextEncoder(MODEL, output="pooled")
    with pytest.raises(ConfigError, match="chunk_rows"):
        TextEncoder(MODEL, chunk_rows=0)


def test_documents_and_queries_through_one_pipeline_find_the_live_documents() -> None:
    """Documents upserted, one updated and one deleted, then queries, through tokenizer, encoder
    and the vector index: a query equal to a document finds it first (score ~1); the deleted one
    never comes back, the updated one only with its new text's score."""
    from aisp.transform.text.vectors import VectorIndex
    from benchmarks.bench_embeddings import stdlib_texts

    docs = stdlib_texts(300)
    rows = [{"op": "upsert", "id": f"d{i}", "text": t} for i, t in enumerate(docs)]
    rows += [
        {"op": "delete", "id": "d7", "text": ""},
        {"op": "upsert", "id": "d9", "text": "pancakes with syrup"},
    ]
    rows += [{"op": "query", "id": f"q{i}", "text": docs[i]} for i in (3, 7, 9, 120)]
    p = Pipeline("search")
    out = CollectSink(columns=["id", "hits", "scores"])
    tokens = p.source("rows", TestingSource(rows, batch_rows=16)).map_batch(
        "tokenize", TextTokenizer(TOKENIZER)
    )
    embedded = tokens.infer("embed", TextEncoder(MODEL), inputs=INPUTS, outputs={"embedding": "embedding"})
    embedded.vector_index("index", VectorIndex(dim=384, k=10, exact_below=100)).sink("out", out)
    p.run()
    got = {r["id"]: (r["hits"], r["scores"]) for r in out.rows}
    assert sorted(got) == ["q120", "q3", "q7", "q9"]
    for q, doc in (("q3", "d3"), ("q120", "d120")):
        hits, scores = got[q]
        assert hits[0] == doc and scores[0] > 0.99 and len(hits) == 10
    assert all("d7" not in hits for hits, _ in got.values())  # deleted
    hits, scores = got["q9"]  # d9's old text: d9 holds another text now
    assert "d9" not in hits or scores[hits.index("d9")] < 0.5


def test_an_embedding_router_sends_queries_to_the_closest_topic_and_the_rest_to_the_fallback() -> None:
    from aisp.transform.text.router import EmbeddingRouter

    tokenizer, encoder = TextTokenizer(TOKENIZER), TextEncoder(MODEL)
    topics = {
        "files": ["open a file and read its lines", "copy a directory tree", "path of a file"],
        "time": ["current date and time", "parse a timestamp", "time zone of a datetime"],
    }
    router = EmbeddingRouter.from_texts(topics, tokenizer, encoder, threshold=0.35, fallback="other")
    queries = [
        "how do I read a text file",
        "what time is it now",
        "the best pancake recipe",
        "delete a folder",
    ]
    p = Pipeline("routes")
    outs = {b: CollectSink(columns=["text", "route", "route_score"]) for b in ("files", "time", "other")}
    rows = [{"text": q} for q in queries]
    tokens = p.source("q", TestingSource(rows)).map_batch("tokenize", tokenizer)
    embedded = tokens.infer("embed", encoder, inputs=INPUTS, outputs={"embedding": "embedding"})
    for branch, stream in router.attach(embedded, "topic").items():
        stream.sink(f"out_{branch}", outs[branch])
    p.run()
    got = {r["text"]: (branch, r["route"], r["route_score"]) for branch, o in outs.items() for r in o.rows}
    assert {q: got[q][0] for q in queries} == {
        "how do I read a text file": "files", "what time is it now": "time",
        "the best pancake recipe": "other", "delete a folder": "files",
    }  # fmt: skip
    assert all(branch == route for branch, route, _ in got.values())  # the decision is on the row
    assert got["the best pancake recipe"][2] < 0.35 < got["what time is it now"][2]


def test_a_repeated_text_is_answered_from_the_cache_with_the_same_embedding() -> None:
    """The same cache in front of the model across two runs: the second run's known texts are
    answered from it, equal, without a model call; its new text costs no store lookup."""
    from aisp.infer.cache.response import ResponseCache, cached

    cache = ResponseCache(["text"], ["embedding"])
    last: list[Pipeline] = []

    def run(texts: list[str]) -> tuple[list[dict[str, object]], int]:
        p = Pipeline("cached")
        out = CollectSink(columns=["id", "text", "embedding", "cached"])
        rows = [{"id": i, "text": t} for i, t in enumerate(texts)]

        def embed(stream: object) -> object:
            tokens = stream.map_batch("tokenize", TextTokenizer(TOKENIZER))  # type: ignore[attr-defined]
            return tokens.infer(
                "embed", TextEncoder(MODEL), inputs=INPUTS, outputs={"embedding": "embedding"}
            )

        cached(p.source("texts", TestingSource(rows, batch_rows=2)), "cache", cache, embed).sink("out", out)
        last[:] = [p]
        summary = p.run()
        return sorted(out.rows, key=lambda r: r["id"]), summary.models["embed"]["rows"]  # type: ignore[no-any-return]

    first, called = run(["the capital of France is Paris", "pancakes with syrup"])
    assert called == 2 and not any(r["cached"] for r in first)
    lookups = cache.stats()["lookups"]
    again, called = run(["pancakes with syrup", "the capital of France is Paris", "a new sentence"])
    assert called == 1 and [r["cached"] for r in again] == [True, True, False]
    assert cache.stats()["lookups"] == lookups + 2  # the new text was turned away by the filter
    for r in first + again:
        np.testing.assert_allclose(r["embedding"], alone(r["text"]), atol=1e-5)  # type: ignore[arg-type]
    registry = CollectorRegistry()
    registry.register(PipelineCollector(LocalExecutor(last[0].build(), dead_letter=DeadLetterSink().open())))
    metrics = generate_latest(registry).decode()
    assert 'aisp_cache_rows_total{outcome="hit",stage="cache"} 2.0' in metrics
    assert 'aisp_tokens_total{stage="tokenize"}' in metrics
