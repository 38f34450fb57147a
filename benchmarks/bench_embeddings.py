"""Sentence embeddings/s: AISP's dynamic batching of single texts vs plain loops on the same model.

The texts: the first paragraphs of the Python standard library's docstrings (offline, 1-120
tokens each). The model: all-MiniLM-L6-v2, int8 ONNX (``aisp.infer.runtimes.text_encoder.packaged_minilm``),
mean pooled and L2-normalised in every variant, on ONNX Runtime with the same session options
(``--threads`` intra-op threads):

* ``per_text``: a loop that tokenises one text and runs the model on it (no padding), the way
  an embedding call per request is written;
* ``batched``: the same loop over chunks of ``--batch`` texts sorted by length first (as
  sentence-transformers' ``encode`` does; ``encode_batch``, padded to the chunk's longest
  text): the strongest plain baseline, for a caller that has all the texts at hand;
* ``aisp``: a pipeline whose source hands over one text at a time (a stream of single texts),
  ``TextTokenizer`` and an ``infer`` step with ``TextEncoder`` and dynamic batching (max batch
  ``--aisp-batch``, ``--instances`` model instances of ``--aisp-threads`` intra-op threads).

Each round runs the three in turn (alternating), over ``--texts`` texts; the report gives the
median of ``--rounds`` rounds and the ratios of the medians.

    python benchmarks/bench_embeddings.py [--texts 3000 --rounds 3 --batch 64 --threads 2
        --aisp-batch 256 --instances 2 --aisp-threads 1]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import numpy as np
import onnxruntime as ort


def stdlib_texts(limit: int) -> list[str]:
    """First paragraphs of public docstrings of standard library modules, de-duplicated."""
    import importlib
    import inspect

    modules = ["os", "json", "re", "collections", "itertools", "functools", "pathlib", "typing",
               "asyncio", "threading", "subprocess", "shutil", "string", "textwrap", "datetime",
               "statistics", "random", "math", "heapq", "bisect", "csv", "sqlite3", "urllib.parse",
               "http.client", "email.message", "logging", "argparse", "inspect", "dataclasses",
               "enum", "decimal", "fractions", "zipfile", "tarfile", "hashlib", "hmac", "socket",
               "selectors", "queue", "contextlib", "abc", "io", "tempfile", "glob", "fnmatch",
               "pickle", "copy", "pprint", "difflib", "unicodedata", "locale", "gettext", "uuid"]  # fmt: skip
    seen: set[str] = set()
    texts: list[str] = []
    for name in modules:
        module = importlib.import_module(name)
        for _, obj in inspect.getmembers(module):
            doc = inspect.getdoc(obj) if callable(obj) else None
            first = (doc or "").split("\n\n")[0].replace("\n", " ").strip()
            if len(first) > 20 and first not in seen:
                seen.add(first)
                texts.append(first)
            if len(texts) >= limit:
                return texts
    return texts


class Plain:
    """The baselines' model: a session, the tokenizer, mean pooling, L2 normalisation."""

    def __init__(self, model: str, tokenizer: str, threads: int) -> None:
        from tokenizers import Tokenizer

        opts = ort.SessionOptions()
        opts.intra_op_num_threads = threads
        opts.inter_op_num_threads = 1
        opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        self.session = ort.InferenceSession(model, opts, providers=["CPUExecutionProvider"])
        self.tok = Tokenizer.from_file(tokenizer)
        self.tok.enable_truncation(128)

    def embed(self, texts: list[str]) -> np.ndarray:
        if len(texts) == 1:
            self.tok.no_padding()
        else:
            self.tok.enable_padding()  # to the longest text of the chunk
        enc = self.tok.encode_batch(texts)
        feed = {
            "input_ids": np.array([e.ids for e in enc], dtype=np.int64),
            "attention_mask": np.array([e.attention_mask for e in enc], dtype=np.int64),
            "token_type_ids": np.array([e.type_ids for e in enc], dtype=np.int64),
        }
        hidden = self.session.run(["last_hidden_state"], feed)[0]
        mask = feed["attention_mask"][:, :, None].astype(np.float32)
        pooled = (hidden * mask).sum(axis=1) / np.maximum(mask.sum(axis=1), 1e-9)
        return pooled / np.linalg.norm(pooled, axis=1, keepdims=True)


def per_text(plain: Plain, texts: list[str]) -> float:
    t0 = time.perf_counter()
    for text in texts:
        plain.embed([text])
    return len(texts) / (time.perf_counter() - t0)


def batched(plain: Plain, texts: list[str], batch: int) -> float:
    t0 = time.perf_counter()
    ordered = sorted(texts, key=len)  # less padding per chunk
    for i in range(0, len(ordered), batch):
        plain.embed(ordered[i : i + batch])
    return len(texts) / (time.perf_counter() - t0)


def through_aisp(
    model: str, tokenizer: str, texts: list[str], batch: int, threads: int, instances: int
) -> dict[str, Any]:
    from aisp import BatcherConfig, NullSink, OnnxRuntime, Pipeline, TestingSource
    from aisp.infer.runtimes.text_encoder import TextEncoder
    from aisp.transform.text.tokenize import TextTokenizer

    p = Pipeline("embed")
    rows = [{"id": i, "text": t} for i, t in enumerate(texts)]
    encoder = TextEncoder(OnnxRuntime(model, name="minilm", intra_op_threads=threads))
    tokens = p.source("texts", TestingSource(rows, batch_rows=1)).map_batch(
        "tokenize", TextTokenizer(tokenizer)
    )
    tokens.infer(
        "embed",
        encoder,
        inputs={n: n for n in ("input_ids", "attention_mask", "token_type_ids")},
        outputs={"embedding": "embedding"},
        batcher=BatcherConfig(max_batch_size=batch, max_queue_delay_ms=5.0, instances=instances),
    ).sink("out", NullSink())
    t0 = time.perf_counter()
    summary = p.run()
    seconds = time.perf_counter() - t0
    return {"per_s": len(texts) / seconds, "mean_batch": summary.models["embed"].get("mean_batch_rows")}


def main() -> int:
    from aisp.infer.runtimes.text_encoder import packaged_minilm

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--texts", type=int, default=3000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2, help="intra-op threads of the plain loops")
    ap.add_argument("--aisp-batch", type=int, default=256)
    ap.add_argument("--aisp-threads", type=int, default=1)
    ap.add_argument("--instances", type=int, default=2)
    args = ap.parse_args()
    model, tokenizer = (str(p) for p in packaged_minilm())
    texts = stdlib_texts(args.texts)
    texts = (texts * (args.texts // len(texts) + 1))[: args.texts]
    plain = Plain(model, tokenizer, args.threads)
    plain.embed(texts[:8])  # warm-up
    runs: dict[str, list[float]] = {"per_text": [], "batched": [], "aisp": []}
    batches = []
    for _ in range(args.rounds):
        runs["per_text"].append(per_text(plain, texts))
        runs["batched"].append(batched(plain, texts, args.batch))
        got = through_aisp(model, tokenizer, texts, args.aisp_batch, args.aisp_threads, args.instances)
        runs["aisp"].append(got["per_s"])
        batches.append(got["mean_batch"])
    med = {k: statistics.median(v) for k, v in runs.items()}
    lengths = [len(plain.tok.encode(t).ids) for t in texts[:500]]
    print(json.dumps({
        "texts": len(texts), "rounds": args.rounds, "batch": args.batch, "threads": args.threads,
        "aisp": {"max_batch": args.aisp_batch, "instances": args.instances, "threads": args.aisp_threads},
        "tokens_p50_p99": [int(np.percentile(lengths, 50)), int(np.percentile(lengths, 99))],
        "embeddings_per_s": {k: [round(x, 1) for x in v] for k, v in runs.items()},
        "median_per_s": {k: round(v, 1) for k, v in med.items()},
        "aisp_mean_batch_rows": batches,
        "aisp_vs_per_text": round(med["aisp"] / med["per_text"], 2),
        "aisp_vs_batched": round(med["aisp"] / med["batched"], 2),
    }, indent=1))  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
