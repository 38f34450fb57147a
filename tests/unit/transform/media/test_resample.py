"""The keyed resampling step: chunks of any sizes give what scipy's ``resample_poly`` gives for
the whole stream, across checkpoints, and the features after it are librosa's."""

from __future__ import annotations

import math
from typing import Any

import librosa
import numpy as np
import pyarrow as pa
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from scipy.signal import resample_poly

from aisp.batch import KEY, Batch
from aisp.errors import ConfigError
from aisp.state.keyed import KeyIndex
from aisp.transform.media.audio import AudioFeatures
from aisp.transform.media.resample import Resample
from aisp.transform.operators import OperatorContext


class Keyed:
    """A keyed operator fed rows of (stream, samples) batch by batch."""

    def __init__(self, spec: Any, index: KeyIndex | None = None) -> None:
        self.index = index or KeyIndex()
        self.op: Any = spec.build(OperatorContext("step", lambda *a, **k: None, {"s": self.index}))

    def feed(self, rows: list[tuple[str, np.ndarray]], column: str = "samples") -> Batch:
        streams = pa.array([s for s, _ in rows], pa.string())
        samples = pa.array([c.tolist() for _, c in rows], pa.list_(pa.float32()))
        batch = Batch.from_columns({"stream": streams, column: samples})
        [(_, out)] = self.op.process(batch.with_columns({KEY: self.index.encode(streams)}))
        return out


def collect(out: Batch, into: dict[str, list[np.ndarray]]) -> None:
    for stream, samples in zip(out.pylist("stream"), out.pylist("samples"), strict=True):
        into.setdefault(stream, []).append(np.asarray(samples, dtype=np.float64))


def reference(x: np.ndarray, rate_in: int, rate_out: int) -> np.ndarray:
    g = math.gcd(rate_in, rate_out)
    return resample_poly(x.astype(np.float64), rate_out // g, rate_in // g)


def noise(n: int, seed: int) -> np.ndarray:
    return (0.3 * np.random.default_rng(seed).standard_normal(n)).astype(np.float32)


@pytest.mark.parametrize(
    ("rate_in", "rate_out"), [(48000, 16000), (44100, 16000), (8000, 16000), (22050, 16000)]
)
def test_a_whole_stream_is_resample_polys_but_its_last_samples(rate_in: int, rate_out: int) -> None:
    x = noise(rate_in // 4, 0)
    step = Keyed(Resample(input_rate=rate_in, sample_rate=rate_out, space="s"))
    got: dict[str, list[np.ndarray]] = {}
    collect(step.feed([("a", x)]), got)
    want = reference(x, rate_in, rate_out)
    ours = got["a"][0]
    # an output is made once every input its filter reads has come: the last few wait for more
    g = math.gcd(rate_in, rate_out)
    up, down = rate_out // g, rate_in // g
    assert len(ours) == (len(x) * up - 10 * max(up, down) - 1) // down + 1
    assert len(want) - len(ours) == math.ceil(10 * max(up, down) / down)
    np.testing.assert_allclose(ours, want[: len(ours)], atol=1e-6, rtol=0)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_chunked_streams_give_the_whole_streams_samples(data: st.DataObject) -> None:
    rate_in = data.draw(st.sampled_from([48000, 44100, 8000, 32000]), label="rate")
    streams = {f"s{i}": noise(2000 + 700 * i, i) for i in range(3)}
    chunks = {}
    for name, x in streams.items():
        points = sorted(data.draw(st.lists(st.integers(0, len(x)), max_size=10), label=name))
        chunks[name] = [x[a:b] for a, b in zip([0, *points], [*points, len(x)], strict=True)]
    rounds = max(map(len, chunks.values()))
    queue = [(name, cs[i]) for i in range(rounds) for name, cs in chunks.items() if i < len(cs)]
    step = Keyed(Resample(input_rate=rate_in, space="s"))
    got: dict[str, list[np.ndarray]] = {}
    while queue:
        take = data.draw(st.integers(1, 6))
        collect(step.feed(queue[:take]), got)
        queue = queue[take:]
    for name, x in streams.items():
        ours = np.concatenate(got[name])
        whole: dict[str, list[np.ndarray]] = {}
        collect(Keyed(Resample(input_rate=rate_in, space="s")).feed([(name, x)]), whole)
        np.testing.assert_allclose(ours, whole[name][0], atol=1e-6, rtol=0)
        np.testing.assert_allclose(ours, reference(x, rate_in, 16000)[: len(ours)], atol=1e-6, rtol=0)


def test_a_restored_checkpoint_carries_on_mid_stream() -> None:
    spec = Resample(input_rate=44100, space="s")
    x = noise(9000, 1)
    first = Keyed(spec)
    got: dict[str, list[np.ndarray]] = {}
    collect(first.feed([("a", x[:4321]), ("b", x[:10])]), got)
    snap = first.op.snapshot()
    restored = Keyed(spec, KeyIndex())
    restored.index.encode(pa.array(["a", "b"]))
    restored.op.restore({k: pa.array(v).to_numpy(zero_copy_only=False) for k, v in snap.items()})
    collect(restored.feed([("a", x[4321:])]), got)
    ours = np.concatenate(got["a"])
    np.testing.assert_allclose(ours, reference(x, 44100, 16000)[: len(ours)], atol=1e-6, rtol=0)
    assert len(ours) >= len(x) * 16000 // 44100 - 12


def test_features_of_a_48khz_stream_in_chunks_are_librosas_of_the_resampled_file() -> None:
    rate = 48000
    t = np.arange(rate) / rate
    x = (0.5 * np.sin(2 * np.pi * (300 + 2000 * t) * t) + 0.05 * noise(rate, 2)).astype(np.float32)
    resample, features = Keyed(Resample(input_rate=rate, space="s")), Keyed(AudioFeatures(space="s"))
    mfcc: list[np.ndarray] = []
    for a in range(0, rate, 4800):  # 100 ms chunks, as a microphone sends them
        out = features.feed(
            [
                ("a", np.asarray(s, np.float32))
                for s in resample.feed([("a", x[a : a + 4800])]).pylist("samples")
            ]
        )
        mfcc.extend(np.asarray(m).reshape(-1, 13) for m in out.pylist("mfcc"))
    ours = np.concatenate(mfcc)
    y = reference(x, rate, 16000).astype(np.float32)
    mel = librosa.feature.melspectrogram(
        y=y.astype(np.float64), sr=16000, n_fft=400, hop_length=160, center=False, n_mels=40
    )
    want = librosa.feature.mfcc(S=librosa.power_to_db(mel, top_db=None), n_mfcc=13).T
    assert len(want) - 1 <= len(ours) <= len(want)
    np.testing.assert_allclose(ours, want[: len(ours)], atol=1e-4, rtol=0)


def test_equal_rates_pass_through_and_settings_are_checked() -> None:
    x = noise(100, 3)
    got: dict[str, list[np.ndarray]] = {}
    collect(Keyed(Resample(input_rate=16000, space="s")).feed([("a", x)]), got)
    np.testing.assert_array_equal(got["a"][0], x)
    with pytest.raises(ConfigError):
        Resample(input_rate=0)
    with pytest.raises(ConfigError, match="not a list"):
        Keyed(Resample(input_rate=8000, space="s", column="stream")).feed([("a", x)])


def test_a_pipeline_decodes_pcm_at_48khz_and_resamples_each_stream() -> None:
    from aisp import CollectSink, Pipeline, TestingSource
    from aisp.transform.media.audio import AudioDecode

    pcm = {s: (noise(9600, i) * 32767).astype("<i2") for i, s in enumerate(["a", "b"])}
    rows = [{"stream": s, "audio": pcm[s][a : a + 960].tobytes()} for a in range(0, 9600, 960) for s in pcm]
    p, out = Pipeline("mic"), CollectSink(columns=["stream", "samples"])
    decoded = p.source("src", TestingSource(rows)).apply(
        "decode", AudioDecode(format="pcm_s16le", input_rate=48000, sample_rate=48000)
    )
    decoded.key_by("by_stream", "stream").apply("resample", Resample(input_rate=48000)).sink("out", out)
    p.run()
    for s, x in pcm.items():
        ours = np.concatenate([r["samples"] for r in out.rows if r["stream"] == s])
        assert len(ours) == 3200 - 10
        np.testing.assert_allclose(ours, reference(x / 32768.0, 48000, 16000)[:3190], atol=1e-6, rtol=0)
