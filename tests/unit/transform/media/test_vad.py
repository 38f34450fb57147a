"""Speech segments: Silero VAD per stream with its recurrent state carried between chunks, so any
cut of a stream, in any batches, and a restore from a checkpoint give the whole stream's answer."""

from __future__ import annotations

from typing import Any

import numpy as np
import pyarrow as pa
import pytest

from aisp.batch import KEY, Batch
from aisp.errors import ConfigError
from aisp.state.keyed import KeyIndex
from aisp.transform.media.vad import SpeechSegments
from aisp.transform.operators import OperatorContext
from benchmarks.workload import load_example

VOICES = load_example("audio/voices.py", "aisp_example_audio_voices")


class Vad:
    def __init__(self, index: KeyIndex | None = None) -> None:
        self.index = index or KeyIndex()
        self.op: Any = SpeechSegments(space="s").build(
            OperatorContext("vad", lambda *a, **k: None, {"s": self.index})
        )
        self.probs: dict[str, list[float]] = {}
        self.segments: dict[str, list[tuple[float, float]]] = {}

    def feed(self, rows: list[tuple[str, np.ndarray]]) -> None:
        streams = pa.array([s for s, _ in rows])
        samples = pa.array([c.tolist() for _, c in rows], pa.list_(pa.float32()))
        batch = Batch.from_columns({"stream": streams, "samples": samples})
        [(_, out)] = self.op.process(batch.with_columns({KEY: self.index.encode(streams)}))
        for s, p, a, b in zip(
            *(out.pylist(c) for c in ("stream", "speech_prob", "speech_start", "speech_end")), strict=True
        ):
            self.probs.setdefault(s, []).extend(p)
            self.segments.setdefault(s, []).extend(zip(a, b, strict=True))


def test_chunks_in_any_batches_give_the_whole_streams_answer() -> None:
    ys = {f"s{i}": VOICES.stream(i, 4.0)[0] for i in range(3)}
    whole = Vad()
    whole.feed(list(ys.items()))
    rng = np.random.default_rng(1)
    chunked = Vad()
    pieces = []
    for name, y in ys.items():
        cuts = np.sort(rng.integers(0, len(y), 25))
        pieces += [(k, name, c) for k, c in enumerate(np.split(y, cuts))]
    pieces.sort(key=lambda p: p[0])  # interleaved, each stream in order
    for start in range(0, len(pieces), 7):
        chunked.feed([(name, c) for _, name, c in pieces[start : start + 7]])
    for name in ys:
        assert len(whole.probs[name]) == len(ys[name]) // 512
        np.testing.assert_allclose(chunked.probs[name], whole.probs[name], atol=1e-5)
        assert chunked.segments[name] == whole.segments[name]
        assert whole.segments[name], "speech found"


def test_a_restored_checkpoint_goes_on_mid_speech() -> None:
    y, _ = VOICES.stream(2, 6.0)
    whole = Vad()
    whole.feed([("a", y)])
    first = Vad()
    cut = 2 * 16000 + 100
    first.feed([("a", y[:cut])])
    snap = first.op.snapshot()
    index = KeyIndex()
    index.encode(pa.array(["a"]))
    second = Vad(index)
    second.op.restore({k: pa.array(v).to_numpy(zero_copy_only=False) for k, v in snap.items()})
    second.feed([("a", y[cut:])])
    np.testing.assert_allclose(first.probs["a"] + second.probs["a"], whole.probs["a"], atol=1e-5)
    assert first.segments["a"] + second.segments["a"] == whole.segments["a"]


def test_settings_are_checked() -> None:
    with pytest.raises(ConfigError, match="threshold"):
        SpeechSegments(threshold=0.1)
