"""Text operators: tokenisation of a text column into token-id columns, a whole batch at a time.

``TextTokenizer`` (a batch function: ``stream.map_batch("tokenize", TextTokenizer(path))``)
runs a Hugging Face ``tokenizers`` tokenizer (a ``tokenizer.json``) over a batch's texts with
``encode_batch`` (Rust, in parallel, without the GIL) and adds the token ids, the attention mask
and the token type ids as list columns of each row's own length, truncated at ``max_length``,
plus each row's number of tokens. Nothing is padded here: a model step pads each batch it forms
to its longest row (``aisp.batch.padded``), so a batch of short texts stays small, and a text
encoder cuts padding further by running rows of similar length together
(``aisp.infer.runtimes.text_encoder.TextEncoder``). A null text is tokenised as an empty one.
``tokens`` counts the tokens made so far.

Needs the ``text`` extra (``pip install 'aisp[text]'``).
"""

from __future__ import annotations

import itertools
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from aisp.batch import Batch
from aisp.errors import ConfigError

__all__ = ["TextTokenizer"]


class TextTokenizer:
    """Token ids of ``column`` (see the module docstring) as ``ids``, ``mask`` and ``type_ids``
    list columns and ``lengths`` (tokens per row)."""

    def __init__(
        self,
        tokenizer_json: str | Path,
        *,
        column: str = "text",
        max_length: int = 128,
        ids: str = "input_ids",
        mask: str = "attention_mask",
        type_ids: str | None = "token_type_ids",
        lengths: str = "n_tokens",
    ) -> None:
        if max_length < 2:
            raise ConfigError(f"max_length must be >= 2 (room for the special tokens), got {max_length}")
        try:
            from tokenizers import Tokenizer
        except ImportError as exc:  # pragma: no cover - the text extra is part of the dev install
            raise ConfigError("TextTokenizer needs the tokenizers package: pip install 'aisp[text]'") from exc
        path = Path(tokenizer_json)
        if not path.is_file():
            raise ConfigError(f"no tokenizer file at {path}")
        self._tok = Tokenizer.from_file(str(path))
        self._tok.no_padding()
        self._tok.enable_truncation(max_length)
        self.column, self.max_length = column, max_length
        self._names = (ids, mask, type_ids, lengths)
        self._lock = threading.Lock()
        self.tokens = 0
        """Tokens made so far (all rows, special tokens included)."""

    def __call__(self, batch: Batch) -> Batch:
        col = batch.column(self.column)
        if not (
            pa.types.is_string(col.type) or pa.types.is_large_string(col.type) or pa.types.is_null(col.type)
        ):
            raise ConfigError(f"column {self.column!r} is {col.type}, not text")
        texts = [t if t is not None else "" for t in col.to_pylist()]
        encodings = self._tok.encode_batch(texts)
        lengths = np.fromiter((len(e.ids) for e in encodings), dtype=np.int64, count=len(encodings))
        total = int(lengths.sum())
        offsets = pa.array(np.concatenate(([0], np.cumsum(lengths))).astype(np.int32))
        flat = np.fromiter(
            itertools.chain.from_iterable(e.ids for e in encodings), dtype=np.int64, count=total
        )
        ids, mask, type_ids, n_tokens = self._names
        cols: dict[str, Any] = {
            ids: pa.ListArray.from_arrays(offsets, pa.array(flat)),
            mask: pa.ListArray.from_arrays(offsets, pa.array(np.ones(total, dtype=np.int64))),
            n_tokens: lengths,
        }
        if type_ids is not None:
            types = itertools.chain.from_iterable(e.type_ids for e in encodings)
            cols[type_ids] = pa.ListArray.from_arrays(
                offsets, pa.array(np.fromiter(types, dtype=np.int64, count=total))
            )
        with self._lock:
            self.tokens += total
        return batch.with_columns(cols)
