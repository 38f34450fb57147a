"""Audio whose header says what decoding it would cost: impossible sample rates, non-finite
samples in any format, and decompression bombs (many channels at a high rate) refused from
the header, with decoding in blocks so memory follows the mono result, not the channels."""

from __future__ import annotations

import io
import struct
import tracemalloc

import numpy as np
import pytest
import soundfile as sf
from hypothesis import given, settings
from hypothesis import strategies as st

from aisp.errors import ConfigError
from aisp.transform.media.audio import RATES_HZ, AudioDecode
from aisp.transform.media.common import MediaError
from tests.unit.transform.media.test_audio import RATE, signal, wav


def with_rate(data: bytes, rate: int) -> bytes:
    """A WAV whose ``fmt `` chunk says ``rate`` (and the byte rate to match)."""
    out = bytearray(data)
    block_align = struct.unpack("<H", out[32:34])[0]
    out[24:32] = struct.pack("<II", rate, (rate * block_align) & 0xFFFFFFFF)
    return bytes(out)


def test_a_sample_rate_of_a_billion_is_refused() -> None:
    data = with_rate(wav(signal(0.1)), 1_000_000_000)
    with pytest.raises(
        MediaError, match=r"impossible sample rate: 1000000000 Hz \(accepted: 1000\.\.768000 Hz\)"
    ):
        AudioDecode().decode(data)


@settings(max_examples=60, deadline=None)
@given(st.one_of(st.integers(1, 2**31 - 1), st.sampled_from([999, 1000, 8000, 768_000, 768_001, 2**32 - 1])))
def test_every_rate_is_decoded_to_samples_or_refused_as_impossible(rate: int) -> None:
    data = with_rate(wav(signal(0.05)), rate)  # 800 frames
    low, high = RATES_HZ
    step = AudioDecode(max_seconds=1.0)
    if rate >= 2**31:  # libsndfile's own check (its rates are C ints)
        with pytest.raises(MediaError):
            step.decode(data)
    elif not low <= rate <= high:
        with pytest.raises(MediaError, match="impossible sample rate"):
            step.decode(data)
    elif 800 / rate > 1.0:
        with pytest.raises(MediaError, match="too long"):
            step.decode(data)
    else:
        assert len(step.decode(data)) == pytest.approx(800 * RATE / rate, abs=1)


def test_settings_outside_the_rates_are_refused() -> None:
    with pytest.raises(ConfigError, match="sample_rate must be 1000..768000 Hz, got 0"):
        AudioDecode(sample_rate=0)
    with pytest.raises(ConfigError, match="input_rate"):
        AudioDecode(format="pcm_s16le", input_rate=10**9)
    with pytest.raises(ConfigError, match="max_samples"):
        AudioDecode(max_samples=0)


@settings(max_examples=60, deadline=None)
@given(
    st.sampled_from(["WAV FLOAT", "WAV DOUBLE", "pcm_f32le"]),
    st.sampled_from([np.nan, np.inf, -np.inf]),
    st.integers(0, 799),
    st.integers(1, 2),
)
def test_non_finite_samples_are_refused_in_every_format(
    kind: str, bad: float, at: int, channels: int
) -> None:
    y = np.tile(signal(0.05)[:, None], (1, channels))
    y[at, channels - 1] = bad
    if kind == "pcm_f32le":
        step, data = AudioDecode(format="pcm_f32le"), y[:, channels - 1].astype("<f4").tobytes()
    else:
        step, data = AudioDecode(), wav(y, subtype=kind.split()[1])
    with pytest.raises(MediaError) as refused:
        step.decode(data)
    assert str(refused.value) == "invalid audio: samples that are not finite (NaN or infinity)"


def flac(seconds: float, channels: int, rate: int) -> bytes:
    """A real FLAC of silence: a few hundred bytes a second of any width."""
    buf = io.BytesIO()
    with sf.SoundFile(buf, "w", samplerate=rate, channels=channels, format="FLAC", subtype="PCM_16") as f:
        f.write(np.zeros((int(seconds * rate), channels), dtype=np.int16))
    return buf.getvalue()


def claim_frames(data: bytes, frames: int) -> bytes:
    """A FLAC whose STREAMINFO says ``frames`` frames (36 bits after rate, channels, depth)."""
    out = bytearray(data)
    assert out[:4] == b"fLaC" and out[4] & 0x7F == 0  # STREAMINFO first
    at = 8 + 13  # block header, then 10 bytes of block and frame sizes, 20 bits of rate...
    packed = int.from_bytes(out[at : at + 5], "big")
    packed = (packed & ~((1 << 36) - 1)) | frames
    out[at : at + 5] = packed.to_bytes(5, "big")
    return bytes(out)


def test_a_bomb_of_many_channels_at_a_high_rate_is_refused_from_its_header() -> None:
    """599 s of 8 channels at 96 kHz passes ``max_seconds=600`` but holds 460 million samples
    (1.8 GB as float32): refused by the header's size before any of it is decoded."""
    data = claim_frames(flac(0.1, 8, 96_000), 599 * 96_000)
    with sf.SoundFile(io.BytesIO(data)) as f:
        assert (f.frames, f.channels, f.samplerate) == (599 * 96_000, 8, 96_000)
    with pytest.raises(
        MediaError, match=r"audio too large: 57504000 frames x 8 channels = 460032000 samples"
    ):
        AudioDecode().decode(data)


@settings(max_examples=30, deadline=None)
@given(st.integers(1, 8), st.integers(200, 4000), st.integers(1_000, 20_000))
def test_inputs_are_refused_exactly_when_frames_times_channels_pass_the_limit(
    channels: int, frames: int, limit: int
) -> None:
    data = wav(np.zeros((frames, channels), dtype=np.float32))
    step = AudioDecode(max_samples=limit)
    if frames * channels > limit:
        with pytest.raises(MediaError, match=f"= {frames * channels} samples \\(limit {limit}\\)"):
            step.decode(data)
    else:
        assert len(step.decode(data)) == frames


def test_decoding_holds_the_mono_result_and_one_block_not_every_channel() -> None:
    """8 channels of 2 s at 96 kHz are 6 MB as float32; decoded block by block into mono, the
    peak of what decoding allocates stays under half of that."""
    y = np.random.default_rng(0).uniform(-0.5, 0.5, (2 * 96_000, 8)).astype(np.float32)
    data = wav(y, rate=96_000, subtype="FLOAT")
    step = AudioDecode(sample_rate=96_000)
    tracemalloc.start()
    try:
        samples = step.decode(data)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    np.testing.assert_allclose(samples, y.mean(axis=1), atol=1e-6)
    assert peak < y.nbytes / 2, (peak, y.nbytes)


@pytest.mark.parametrize("claimed", [16_000, 2**36 - 1])
def test_a_file_shorter_than_its_header_says_is_refused(claimed: int) -> None:
    data = claim_frames(flac(0.5, 2, 16_000), claimed)  # holds 0.5 s
    with pytest.raises(MediaError, match="truncated|corrupt|too long"):
        AudioDecode().decode(data)
