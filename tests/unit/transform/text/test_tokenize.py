"""Token ids of a text column, a batch at a time, equal to the tokenizer's own per text; ragged
list columns padded for a model step."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from aisp.batch import Batch, padded
from aisp.errors import ConfigError
from aisp.infer.runtimes.text_encoder import packaged_minilm
from aisp.transform.text.tokenize import TextTokenizer

_, TOKENIZER = packaged_minilm()


def reference() -> object:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(TOKENIZER))
    tok.no_padding()
    tok.enable_truncation(16)
    return tok


@given(st.lists(st.lists(st.integers(-(2**40), 2**40), max_size=12), max_size=20), st.integers(0, 5))
def test_padding_a_ragged_column_matches_row_by_row(rows: list[list[int]], skip: int) -> None:
    col = pa.array(rows, pa.list_(pa.int64())).slice(min(skip, len(rows)))
    want = [r for r in rows[min(skip, len(rows)) :]]
    got = padded(col)
    width = max((len(r) for r in want), default=0)
    assert got.shape == (len(want), width)
    assert got.tolist() == [r + [0] * (width - len(r)) for r in want]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.one_of(st.none(), st.text(max_size=80)), max_size=20))
def test_any_texts_tokenise_as_the_tokenizer_does_text_by_text(texts: list[str | None]) -> None:
    tokenize = TextTokenizer(TOKENIZER, max_length=16)
    out = tokenize(Batch.from_columns({"text": pa.array(texts, pa.string())}))
    tok = reference()
    ids = out.column("input_ids").to_pylist()
    assert ids == [tok.encode(t or "").ids for t in texts]  # type: ignore[attr-defined]
    lengths = out.numpy("n_tokens").tolist()
    assert lengths == [len(r) for r in ids] and all(2 <= n <= 16 for n in lengths)
    assert out.column("attention_mask").to_pylist() == [[1] * n for n in lengths]
    assert out.column("token_type_ids").to_pylist() == [[0] * n for n in lengths]
    assert tokenize.tokens == sum(lengths)


def test_a_column_that_is_not_text_is_refused_and_bad_settings_fail_where_declared() -> None:
    with pytest.raises(ConfigError, match="not text"):
        TextTokenizer(TOKENIZER)(Batch.from_columns({"text": np.arange(3)}))
    with pytest.raises(ConfigError, match="max_length"):
        TextTokenizer(TOKENIZER, max_length=1)
    with pytest.raises(ConfigError, match="no tokenizer file"):
        TextTokenizer("/nowhere/tokenizer.json")
