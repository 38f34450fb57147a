"""Tokenisation of text that arrives in pieces: a caption, a transcript or a chat message streamed
a few characters at a time, each piece an event of its stream.

``StreamingTokenizer`` (``stream.apply("tokens", StreamingTokenizer(path))``) gives each row the
token ids of the text its piece completed, so that a stream's ids, joined, are the ids of its
whole text (``tokenizer.encode(whole, add_special_tokens=False)``), however the text was cut.
A piece can end inside a word (or a character sequence the tokenizer merges), so the text after
the last whitespace is held, with that whitespace, until more of the stream comes: Hugging Face
tokenizers never merge across whitespace (WordPiece and BPE pre-tokenizers split there; a
byte-level BPE attaches a space to the word after it, which is why the space is held too). A row
whose ``end`` column is true ends its stream: what is held is tokenised with it. At the end of a
bounded input every held tail is tokenised, as a row of its own with an empty piece.

Text with no whitespace for ``max_pending_chars`` (a long run of CJK, a URL) is cut there
anyway, so a stream holds a bounded amount; only there can its ids differ from the whole
text's. The held tails are the step's checkpointed state (restored, a stream goes on where it
was). No special tokens are added: a model step that wants them adds them to whole inputs.
Rows are taken in order, so the steps before must keep each stream's order (a keyed stream does).

Needs the ``text`` extra (``tokenizers``).
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import pyarrow as pa

from aisp.batch import Batch
from aisp.errors import ConfigError
from aisp.graph import DEFAULT_PORT
from aisp.transform.operators import Emit, Operator, OperatorContext

__all__ = ["StreamingTokenizer", "StreamingTokenizerOp"]

_TAIL = re.compile(r"\s+\S*\Z")


@dataclass(frozen=True, kw_only=True)
class StreamingTokenizer:
    """Token ids of text streamed in pieces (see the module docstring)."""

    tokenizer_json: str | Path
    stream_column: str = "stream"
    column: str = "text"
    end_column: str | None = "end"
    ids: str = "input_ids"
    lengths: str = "n_tokens"
    max_pending_chars: int = 4096

    def __post_init__(self) -> None:
        if self.max_pending_chars < 1:
            raise ConfigError(f"max_pending_chars must be >= 1, got {self.max_pending_chars}")
        if not Path(self.tokenizer_json).is_file():
            raise ConfigError(f"no tokenizer file at {self.tokenizer_json}")

    def build(self, ctx: OperatorContext) -> Operator:
        return StreamingTokenizerOp(self)


class StreamingTokenizerOp:
    """The running tokenizer: each stream's held tail (see the module docstring)."""

    def __init__(self, spec: StreamingTokenizer) -> None:
        try:
            from tokenizers import Tokenizer
        except ImportError as exc:  # pragma: no cover - the text extra is part of the dev install
            raise ConfigError(
                "StreamingTokenizer needs the tokenizers package: pip install 'aisp[text]'"
            ) from exc
        self.spec = spec
        self._tok = Tokenizer.from_file(str(spec.tokenizer_json))
        self._tok.no_truncation()
        self._tok.no_padding()
        self.pending: dict[str, str] = {}

    def cut(self, stream: str, piece: str, end: bool) -> str:
        """The text ``piece`` completes for ``stream`` (what is held before it, then the piece, up
        to its last whitespace), holding the rest; all of it when ``end``."""
        text = self.pending.pop(stream, "") + piece
        if end:
            return text
        tail = _TAIL.search(text)
        at = tail.start() if tail is not None else 0
        if len(text) - at > self.spec.max_pending_chars:  # bounded: cut inside the run
            at = len(text) - self.spec.max_pending_chars
        if at < len(text):
            self.pending[stream] = text[at:]
        return text[:at]

    def process(self, batch: Batch) -> Emit:
        spec = self.spec
        streams = [str(s) for s in batch.column(spec.stream_column).to_pylist()]
        pieces = [p or "" for p in batch.column(spec.column).to_pylist()]
        ends = (
            [bool(e) for e in batch.column(spec.end_column).to_pylist()]
            if spec.end_column is not None and spec.end_column in batch
            else [False] * len(streams)
        )
        ready = [self.cut(s, p, e) for s, p, e in zip(streams, pieces, ends, strict=True)]
        return [(DEFAULT_PORT, batch.with_columns(self._encode(ready)))]

    def flush(self) -> Emit:
        """The held tails, tokenised: a row each, its piece empty."""
        if not self.pending:
            return []
        streams, tails = list(self.pending), list(self.pending.values())
        self.pending = {}
        spec = self.spec
        cols: dict[str, Any] = {
            spec.stream_column: pa.array(streams, pa.string()),
            spec.column: [""] * len(streams),
        }
        if spec.end_column is not None:
            cols[spec.end_column] = np.ones(len(streams), dtype=bool)
        return [(DEFAULT_PORT, Batch.from_columns({**cols, **self._encode(tails)}))]

    def _encode(self, texts: list[str]) -> dict[str, Any]:
        encodings = self._tok.encode_batch(texts, add_special_tokens=False) if texts else []
        lengths = np.fromiter((len(e.ids) for e in encodings), dtype=np.int64, count=len(encodings))
        total = int(lengths.sum())
        offsets = pa.array(np.concatenate(([0], np.cumsum(lengths))).astype(np.int32))
        flat = np.fromiter(
            itertools.chain.from_iterable(e.ids for e in encodings), dtype=np.int64, count=total
        )
        return {self.spec.ids: pa.ListArray.from_arrays(offsets, pa.array(flat)), self.spec.lengths: lengths}

    # -- checkpoints --------------------------------------------------------------------------
    def snapshot(self) -> dict[str, npt.NDArray[Any]]:
        """Each stream's held tail."""
        return {
            "__stream": np.array(list(self.pending), dtype=object),
            "__pending": np.array(list(self.pending.values()), dtype=object),
        }

    def restore(self, columns: Mapping[str, npt.NDArray[Any]]) -> None:
        self.pending = {
            str(s): str(t)
            for s, t in zip(columns.get("__stream", ()), columns.get("__pending", ()), strict=True)
        }
