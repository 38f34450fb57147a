"""Audio steps: decoding with dead letters for hostile input, and log-mel/MFCC features whose
per-stream carry-over makes chunked streams give the features of the whole file (and
librosa's values)."""

from __future__ import annotations

import io
from typing import Any

import librosa
import numpy as np
import pyarrow as pa
import pytest
import soundfile as sf
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from aisp.batch import KEY, Batch
from aisp.errors import ConfigError
from aisp.state.keyed import KeyIndex
from aisp.transform.media.audio import AudioDecode, AudioDecodeOp, AudioFeatures, mel_filters
from aisp.transform.media.images import MediaError
from aisp.transform.operators import OperatorContext

RATE = 16000


def signal(seconds: float, seed: int = 0, rate: int = RATE) -> np.ndarray:
    """A chirp with noise and a silent gap: every band gets something, some get nothing."""
    rng = np.random.default_rng(seed)
    t = np.arange(int(seconds * rate)) / rate
    y = 0.5 * np.sin(2 * np.pi * (200 + 900 * t) * t) + 0.05 * rng.standard_normal(t.shape)
    y[len(y) // 3 : len(y) // 3 + rate // 10] = 0.0
    return y.astype(np.float32)


def wav(y: np.ndarray, rate: int = RATE, fmt: str = "WAV", subtype: str = "PCM_16") -> bytes:
    buf = io.BytesIO()
    sf.write(buf, y, rate, format=fmt, subtype=subtype)
    return buf.getvalue()


class Features:
    """An ``AudioFeatures`` operator fed rows of (stream, samples) batch by batch."""

    def __init__(self, spec: AudioFeatures | None = None, index: KeyIndex | None = None) -> None:
        self.spec = spec or AudioFeatures(space="s")
        self.index = index or KeyIndex()
        self.op: Any = self.spec.build(OperatorContext("mfcc", lambda *a, **k: None, {"s": self.index}))

    def feed(self, rows: list[tuple[str, np.ndarray]]) -> Batch:
        streams = pa.array([s for s, _ in rows])
        samples = pa.array([c.tolist() for _, c in rows], pa.list_(pa.float32()))
        batch = Batch.from_columns({"stream": streams, "samples": samples})
        batch = batch.with_columns({KEY: self.index.encode(streams)})
        [(_, out)] = self.op.process(batch)
        return out


def frames_of(out: Batch, name: str, width: int) -> dict[str, list[np.ndarray]]:
    got: dict[str, list[np.ndarray]] = {}
    for stream, flat in zip(out.pylist("stream"), out.pylist(name), strict=True):
        got.setdefault(stream, []).append(np.asarray(flat, dtype=np.float64).reshape(-1, width))
    return got


def whole(y: np.ndarray, spec: AudioFeatures) -> tuple[np.ndarray, ...]:
    f = Features(spec)
    out = f.feed([("x", y)])
    return tuple(np.asarray(out.pylist(n)[0]).reshape(-1, w) for n, w in
                 (("log_mel", spec.n_mels), ("mfcc", spec.n_mfcc), ("mfcc_norm", spec.n_mfcc)))  # fmt: skip


def test_mel_filters_are_librosas() -> None:
    ours = mel_filters(RATE, 400, 40)
    ref = librosa.filters.mel(sr=RATE, n_fft=400, n_mels=40)
    np.testing.assert_allclose(ours, ref, rtol=1e-5, atol=1e-8)
    np.testing.assert_allclose(mel_filters(22050, 512, 64, 50.0, 8000.0),
                               librosa.filters.mel(sr=22050, n_fft=512, n_mels=64, fmin=50, fmax=8000),
                               rtol=1e-5, atol=1e-8)  # fmt: skip


@pytest.mark.parametrize(("n_fft", "hop", "n_mels", "n_mfcc"), [(400, 160, 40, 13), (512, 256, 64, 20)])
def test_features_match_librosa(n_fft: int, hop: int, n_mels: int, n_mfcc: int) -> None:
    y = signal(1.3)
    spec = AudioFeatures(space="s", n_fft=n_fft, hop=hop, n_mels=n_mels, n_mfcc=n_mfcc)
    log_mel, mfcc, _ = whole(y, spec)
    mel = librosa.feature.melspectrogram(y=y.astype(np.float64), sr=RATE, n_fft=n_fft, hop_length=hop,
                                         center=False, n_mels=n_mels)  # fmt: skip
    ref_db = librosa.power_to_db(mel, top_db=None)
    ref_mfcc = librosa.feature.mfcc(S=ref_db, n_mfcc=n_mfcc)
    assert log_mel.shape == ref_db.T.shape
    np.testing.assert_allclose(log_mel, ref_db.T, atol=1e-4, rtol=0)
    np.testing.assert_allclose(mfcc, ref_mfcc.T, atol=1e-4, rtol=0)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_chunked_streams_give_the_whole_files_features(data: st.DataObject) -> None:
    spec = AudioFeatures(space="s")
    streams = {f"s{i}": signal(0.4 + 0.2 * i, seed=i) for i in range(3)}
    # each stream cut at random points (chunks from empty to longer than a frame)
    cuts = {}
    for name, y in streams.items():
        points = sorted(data.draw(st.lists(st.integers(0, len(y)), max_size=12), label=name))
        cuts[name] = [y[a:b] for a, b in zip([0, *points], [*points, len(y)], strict=True)]
    # interleaved, in batches of random sizes (a stream may have several chunks in one batch)
    rounds = max(map(len, cuts.values()))
    queue = [(name, cs[i]) for i in range(rounds) for name, cs in cuts.items() if i < len(cs)]
    f = Features(spec)
    outs: dict[str, dict[str, list[np.ndarray]]] = {"log_mel": {}, "mfcc": {}, "mfcc_norm": {}}
    while queue:
        take = data.draw(st.integers(1, 6))
        out = f.feed(queue[:take])
        queue = queue[take:]
        for name, width in (("log_mel", 40), ("mfcc", 13), ("mfcc_norm", 13)):
            for stream, parts in frames_of(out, name, width).items():
                outs[name].setdefault(stream, []).extend(parts)
    for stream, y in streams.items():
        for got, want in zip((outs[n][stream] for n in outs), whole(y, spec), strict=True):
            np.testing.assert_allclose(np.concatenate(got), want, atol=1e-4, rtol=0)


def test_frame_positions_and_checkpoint_restore_carry_on() -> None:
    spec = AudioFeatures(space="s")
    y = signal(1.0)
    f = Features(spec)
    first = f.feed([("a", y[:1000]), ("b", y[:50])])
    assert first.numpy("n_frames").tolist() == [1 + (1000 - 400) // 160, 0]
    assert first.numpy("first_frame").tolist() == [0, 0]
    snap = f.op.snapshot()  # a checkpoint of the keyed state, restored into a fresh operator
    g = Features(spec, KeyIndex())
    g.index.encode(pa.array(["a", "b"]))
    g.op.restore({k: pa.array(v).to_numpy(zero_copy_only=False) for k, v in snap.items()})
    later = g.feed([("a", y[1000:])])
    assert later.numpy("first_frame").tolist() == [4]
    _, mfcc, norm = whole(y, spec)
    got = np.asarray(later.pylist("mfcc")[0]).reshape(-1, 13)
    np.testing.assert_allclose(got, mfcc[4:], atol=1e-4)
    np.testing.assert_allclose(np.asarray(later.pylist("mfcc_norm")[0]).reshape(-1, 13), norm[4:], atol=1e-4)


class Decoder:
    def __init__(self, **settings: Any) -> None:
        self.dead: dict[int, str] = {}

        def dead_letter(b: Batch, step: str, reason: str, fields: Any = None) -> None:
            self.dead.update(dict.fromkeys(b.ids.tolist(), reason))

        self.spec = AudioDecode(**settings)
        self.op = self.spec.build(OperatorContext("decode", dead_letter))
        assert isinstance(self.op, AudioDecodeOp)

    def run(self, payloads: list[bytes | None]) -> Batch:
        batch = Batch.from_columns({"audio": pa.array(payloads, pa.binary())}, ids=np.arange(len(payloads)))
        [(_, out)] = self.op.process(batch)
        return out


def test_decode_wav_flac_and_pcm_to_mono_at_the_rate() -> None:
    y = signal(0.5)
    stereo = np.stack([y, y], axis=1)
    pcm = (np.clip(y, -1, 1) * 32767).astype("<i2").tobytes()
    d = Decoder()
    out = d.run([wav(y), wav(stereo, fmt="FLAC"), wav(signal(0.5, rate=8000), 8000)])
    assert not d.dead
    got = out.pylist("samples")
    assert len(got[0]) == len(got[1]) == len(y) == len(got[2])
    np.testing.assert_allclose(got[0], y, atol=1 / 16000)
    np.testing.assert_allclose(out.numpy("audio_seconds"), 0.5)
    raw = Decoder(format="pcm_s16le", input_rate=RATE).run([pcm, pcm[:-1]])
    assert raw.ids.tolist() == [0]
    np.testing.assert_allclose(raw.pylist("samples")[0], y, atol=1 / 16000)


def test_hostile_audio_becomes_dead_letters_with_reasons() -> None:
    y = signal(0.3)
    good = wav(y)
    flac = wav(y, fmt="FLAC")
    corrupt = bytearray(flac)
    corrupt[40:400] = bytes(360)
    cases = {
        "zero-length": (b"", "empty"),
        "null": (None, "null"),
        "truncated wav": (good[: len(good) // 2], "truncated"),
        "wav header only": (good[:44], "truncated"),
        "corrupt flac": (bytes(corrupt), "corrupt"),
        "text": (b"this is not audio at all", "not audio"),
        "png": (b"\x89PNG\r\n\x1a\n" + bytes(40), "not audio"),
        "too long": (wav(signal(3.0)), "too long"),
    }
    d = Decoder(max_seconds=2.0)
    out = d.run([good, *(p for p, _ in cases.values()), good])
    n = len(cases) + 2
    assert out.ids.tolist() == [0, n - 1]
    for i, (name, (_, word)) in enumerate(cases.items(), start=1):
        assert word in d.dead[i], (name, d.dead[i])


def test_settings_are_checked() -> None:
    with pytest.raises(ConfigError, match="hop"):
        AudioFeatures(hop=500, n_fft=400)
    with pytest.raises(ConfigError, match="format"):
        AudioDecode(format="mp3")


SEED_AUDIO = [
    wav(signal(0.05)),
    wav(signal(0.05), fmt="FLAC"),
    wav(signal(0.05), fmt="OGG", subtype="VORBIS"),
]


@st.composite
def mutated(draw: st.DrawFn) -> bytes:
    if draw(st.booleans()):
        return draw(st.binary(max_size=256))
    data = bytearray(draw(st.sampled_from(SEED_AUDIO)))
    for _ in range(draw(st.integers(0, 6))):
        data[draw(st.integers(0, len(data) - 1))] = draw(st.integers(0, 255))
    return bytes(data[: draw(st.integers(0, len(data)))])


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(mutated(), min_size=1, max_size=5))
def test_fuzz_every_row_is_decoded_or_a_dead_letter(payloads: list[bytes]) -> None:
    d = Decoder(max_seconds=5.0)
    out = d.run(list(payloads))
    kept = set(out.ids.tolist())
    assert kept.isdisjoint(d.dead) and kept | set(d.dead) == set(range(len(payloads)))
    for i, samples in zip(out.ids.tolist(), out.pylist("samples"), strict=True):
        assert len(samples) > 0 and np.isfinite(samples).all()
        assert len(samples) <= 5 * RATE, i
    for i in d.dead:
        with pytest.raises(MediaError):
            d.spec.decode(payloads[i])
