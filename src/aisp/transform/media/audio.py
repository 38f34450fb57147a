"""Audio preprocessing: decoding to samples, then log-mel and MFCC features per stream, chunk by chunk.

``AudioDecode`` (``stream.apply("decode", AudioDecode(sample_rate=16000))``) turns each row's
bytes into mono float32 samples at ``sample_rate`` (a list column, ``samples``, and
``audio_seconds``): WAV, FLAC and Ogg through libsndfile (``soundfile``), or raw little-endian
PCM (``format="pcm_s16le"`` or ``"pcm_f32le"`` at ``input_rate``), as a microphone's chunks come
over a WebSocket; other rates are resampled with soxr, input by input (a stream of chunks is
resampled by the keyed ``Resample`` step, ``aisp.transform.media.resample``, which carries each
stream's filter from chunk to chunk). libsndfile and soxr release the GIL, so
the rows decode on one thread per core. An empty, truncated, corrupt or unknown input, one of
a sample rate outside ``RATES_HZ``, one longer than ``max_seconds`` or of more samples (frames x
channels, from its header, before decoding) than ``max_samples``, or one with samples that are
not finite (NaN, infinity; in any format) is a dead letter with the reason; the other rows go
on. A file is decoded ``BLOCK_FRAMES`` at a time, each block mixed to mono, so its channels are
never held all at once.

``AudioFeatures`` (keyed by stream id: ``stream.key_by("by_stream", "stream").apply("mfcc",
AudioFeatures())``) frames each stream's samples (``n_fft`` samples every ``hop`` samples,
periodic Hann window), and gives each row the frames its samples complete: power spectrum
(``numpy.fft.rfft``, all the batch's frames at once), mel filter bank (Slaney's scale and area
normalisation, as librosa's default), dB (``10 log10(max(S, 1e-10))``) and MFCC (orthonormal
DCT-II of the dB mel bands), flattened into list columns ``log_mel`` and ``mfcc`` (frames x bands,
row-major) with ``n_frames`` and ``first_frame`` (the stream's frame index of the row's first
frame: its start is ``first_frame * hop / sample_rate`` seconds). Each stream's state carries
from chunk to chunk: the samples of its last chunk that no frame has used yet and the running
sums of its MFCC, which make ``mfcc_norm``, each frame's MFCC less the mean and over the standard
deviation of every frame of the stream so far (streaming cepstral mean and variance
normalisation). The state is keyed state: checkpointed, restored, paged to the state store as
any other. So a stream cut into chunks of any sizes gives the features of the whole stream,
frame for frame. librosa's ``power_to_db`` clips at 80 dB below the loudest bin of what it is
given (``top_db``); that depends on the whole input, which a stream does not have, so it is not
done here (pass ``top_db=None`` to librosa to compare).

Needs the ``media`` extra (``pip install 'aisp[media]'``).
"""

from __future__ import annotations

import io
import time
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import numpy as np
import numpy.typing as npt
import pyarrow as pa

from aisp.batch import KEY, Batch
from aisp.errors import ConfigError
from aisp.graph import DEFAULT_PORT
from aisp.transform.media.common import (
    MediaCounters,
    MediaError,
    binary_payloads,
    cores,
    dead_letter_rows,
    plain,
    run_sliced,
    samples_column,
)
from aisp.transform.operators import Emit, Operator, OperatorContext
from aisp.transform.stateful import Stateful, StateView

__all__ = ["BLOCK_FRAMES", "RATES_HZ", "AudioDecode", "AudioFeatures", "mel_filters"]

_FORMATS = ("auto", "pcm_s16le", "pcm_f32le")


def _soundfile() -> Any:
    try:
        import soundfile
    except (ImportError, OSError) as exc:  # pragma: no cover - the media extra is part of the dev install
        raise ConfigError("audio steps need soundfile: pip install 'aisp[media]'") from exc
    return soundfile


def _wav_truncated(data: bytes) -> bool:
    """Whether a RIFF/WAVE file's ``data`` chunk says more bytes than the file holds."""
    i = 12
    while i + 8 <= len(data):
        size = int.from_bytes(data[i + 4 : i + 8], "little")
        if data[i : i + 4] == b"data":
            return i + 8 + size > len(data) and size != 0xFFFFFFFF  # streaming WAVs leave it unset
        i += 8 + size + (size & 1)
    return True  # no data chunk


RATES_HZ = (1_000, 768_000)
"""The sample rates an input may have, lowest and highest (Hz): 1 kHz (an eighth of telephony's
8 kHz) to the 768 kHz of the fastest audio converters. A header outside them is impossible
audio (a rate field of 1e9 would resample a file to nothing)."""
BLOCK_FRAMES = 1 << 14
"""Frames decoded at a time: a file is decoded block by block, each block mixed to mono, so
decoding holds one block of all channels besides the mono result."""


def _sndfile_reason(exc: Any) -> str:
    """A dead letter's reason for libsndfile's error (its own words, no Python objects):
    unsupported, not audio, or corrupt as libsndfile says."""
    text = plain(str(getattr(exc, "error_string", "") or exc)).removeprefix("Error : ")
    low = text.lower()
    if "not recognised" in low:
        return f"not audio: {text}"
    if "unimplemented" in low or "unsupported" in low or "not supported" in low:
        return f"unsupported audio: {text}"
    return f"corrupt audio: {text}"


@dataclass(frozen=True, kw_only=True)
class AudioDecode:
    """The audio decoding step's settings (see the module docstring)."""

    sample_rate: int = 16000
    column: str = "audio"
    output: str = "samples"
    format: str = "auto"
    input_rate: int = 16000
    """The rate of raw PCM input (``format="pcm_..."``)."""
    max_seconds: float = 600.0
    max_samples: int = 600 * 48_000 * 2
    """The most samples (frames x channels) an input may hold, from its header, before it is
    decoded: ten minutes of 48 kHz stereo. With ``max_seconds`` it bounds the work of decoding
    and its memory (at most 4 bytes a sample), which the duration alone does not: a FLAC of
    599 s of silence in 8 channels at 96 kHz is under 500 KB and holds 460 million samples."""
    threads: int = 0
    counters: MediaCounters = field(default_factory=lambda: MediaCounters("samples"), compare=False)

    def __post_init__(self) -> None:
        if self.format not in _FORMATS:
            raise ConfigError(f"format must be one of {list(_FORMATS)}, got {self.format!r}")
        low, high = RATES_HZ
        for name, rate in (("sample_rate", self.sample_rate), ("input_rate", self.input_rate)):
            if not low <= rate <= high:
                raise ConfigError(f"{name} must be {low}..{high} Hz, got {rate}")
        if self.max_seconds <= 0 or self.max_samples < 1:
            raise ConfigError(
                f"max_seconds must be > 0 and max_samples >= 1, got {self.max_seconds}, {self.max_samples}"
            )

    def build(self, ctx: OperatorContext) -> Operator:
        return AudioDecodeOp(self, ctx)

    def decode(self, data: bytes | None) -> npt.NDArray[np.float32]:
        """One input's mono samples at ``sample_rate``; ``MediaError`` with the reason."""
        if data is None:
            raise MediaError("no audio (null)")
        if not data:
            raise MediaError("empty audio (zero bytes)")
        samples, rate = self._decode_file(data) if self.format == "auto" else self._decode_pcm(data)
        if not np.isfinite(samples).all():  # one check for every format (float WAV, raw f32le)
            raise MediaError("invalid audio: samples that are not finite (NaN or infinity)")
        if rate != self.sample_rate:
            import soxr

            samples = soxr.resample(samples, rate, self.sample_rate, quality="HQ").astype(np.float32)
        if not len(samples):
            raise MediaError(f"empty audio: shorter than one sample at {self.sample_rate} Hz")
        return samples

    def check(self, frames: int, channels: int, rate: int) -> None:
        """Refuse, from its header and before decoding, an input of ``frames`` frames of
        ``channels`` channels at ``rate`` Hz that is empty, of an impossible rate, longer than
        ``max_seconds`` or larger than ``max_samples``."""
        low, high = RATES_HZ
        if not low <= rate <= high:
            raise MediaError(f"impossible sample rate: {rate} Hz (accepted: {low}..{high} Hz)")
        if frames <= 0:
            raise MediaError("empty audio (no samples)")
        if frames / rate > self.max_seconds:
            raise MediaError(f"audio too long: {frames / rate:.1f} s (limit {self.max_seconds})")
        if frames * channels > self.max_samples:
            raise MediaError(
                f"audio too large: {frames} frames x {channels} channels = {frames * channels} samples "
                f"(limit {self.max_samples})"
            )

    def _decode_pcm(self, data: bytes) -> tuple[npt.NDArray[np.float32], int]:
        width = 2 if self.format == "pcm_s16le" else 4
        if len(data) % width:
            raise MediaError(f"truncated PCM: {len(data)} bytes is not a whole number of samples")
        self.check(len(data) // width, 1, self.input_rate)
        if width == 2:
            return np.frombuffer(data, dtype="<i2").astype(np.float32) / np.float32(32768.0), self.input_rate
        return np.frombuffer(data, dtype="<f4").astype(np.float32), self.input_rate

    def _decode_file(self, data: bytes) -> tuple[npt.NDArray[np.float32], int]:
        """A file's mono samples and rate, checked from its header, then decoded block by block
        into the mono result (at most ``max_samples`` from the header, whatever follows it)."""
        sf = _soundfile()
        if data[:4] == b"RIFF" and data[8:12] == b"WAVE":
            if _wav_truncated(data):
                raise MediaError("truncated WAV: shorter than its data chunk says")
        elif data[:4] not in (b"fLaC", b"OggS"):
            raise MediaError("not audio: no WAV, FLAC or Ogg signature")
        try:
            with sf.SoundFile(io.BytesIO(data)) as f:
                frames, channels, rate = int(f.frames), int(f.channels), int(f.samplerate)
                self.check(frames, channels, rate)
                mono = np.empty(frames, dtype=np.float32)
                block = np.empty((min(frames, BLOCK_FRAMES), channels), dtype=np.float32)
                got = 0
                while got < frames:
                    part = f.read(dtype="float32", always_2d=True, out=block[: min(len(block), frames - got)])
                    if not len(part):
                        break
                    np.mean(part, axis=1, dtype=np.float32, out=mono[got : got + len(part)])
                    got += len(part)
        except MediaError:
            raise
        except sf.LibsndfileError as exc:
            raise MediaError(_sndfile_reason(exc)) from None
        except (RuntimeError, ValueError, TypeError) as exc:
            raise MediaError(f"unreadable audio: {plain(str(exc))}") from None
        if got < frames:
            raise MediaError(f"truncated audio: {got} of {frames} frames")
        return mono, rate


class AudioDecodeOp:
    """The running audio decoding step."""

    def __init__(self, spec: AudioDecode, ctx: OperatorContext) -> None:
        self.spec, self._ctx = spec, ctx
        self._threads = spec.threads or cores()

    def process(self, batch: Batch) -> Emit:
        spec = self.spec
        payloads = binary_payloads(batch, spec.column)
        out: list[npt.NDArray[np.float32] | None] = [None] * len(payloads)
        errors: list[str | None] = [None] * len(payloads)

        def work(start: int, end: int) -> tuple[int, int]:
            took, nbytes = time.perf_counter_ns(), 0
            for i in range(start, end):
                data = payloads[i]
                nbytes += len(data or b"")
                try:
                    out[i] = spec.decode(data)
                except MediaError as exc:
                    errors[i] = str(exc)
            return nbytes, time.perf_counter_ns() - took

        done = run_sliced(self._threads, len(payloads), work)
        bad = [(i, e) for i, e in enumerate(errors) if e is not None]
        samples, lengths = samples_column([s for s in out if s is not None])
        spec.counters.add(
            items=len(lengths),
            refused=len(bad),
            nbytes=sum(b for b, _ in done),
            decode_ns=sum(t for _, t in done),
            units=int(lengths.sum()),
        )
        if bad:
            dead_letter_rows(self._ctx, batch, bad)
            batch = batch.take([i for i, e in enumerate(errors) if e is None])
        cols = {spec.output: samples, "audio_seconds": lengths / spec.sample_rate}
        return [(DEFAULT_PORT, batch.with_columns(cols))]

    def flush(self) -> Emit:
        return []


def _hz_to_mel(f: npt.NDArray[np.float64]) -> npt.NDArray[np.float64]:
    """Slaney's mel scale: linear to 1 kHz, logarithmic above."""
    lin = f / (200.0 / 3)
    log = 15.0 + np.log(np.maximum(f, 1e-10) / 1000.0) / (np.log(6.4) / 27.0)
    return np.where(f >= 1000.0, log, lin)


def _mel_to_hz(m: npt.NDArray[np.float64]) -> npt.NDArray[np.float64]:
    lin = m * (200.0 / 3)
    log = 1000.0 * np.exp((np.log(6.4) / 27.0) * (m - 15.0))
    return np.where(m >= 15.0, log, lin)


def mel_filters(
    sample_rate: int, n_fft: int, n_mels: int, fmin: float = 0.0, fmax: float | None = None
) -> npt.NDArray[np.float64]:
    """``[n_mels, 1 + n_fft // 2]`` triangular filters on Slaney's mel scale, each scaled to unit
    area (librosa's ``filters.mel`` defaults)."""
    top = sample_rate / 2 if fmax is None else fmax
    freqs = np.linspace(0, sample_rate / 2, 1 + n_fft // 2)
    edges = _mel_to_hz(np.linspace(_hz_to_mel(np.array(fmin)), _hz_to_mel(np.array(top)), n_mels + 2))
    widths = np.diff(edges)
    ramps = edges[:, None] - freqs[None, :]
    lower = -ramps[:-2] / widths[:-1, None]
    upper = ramps[2:] / widths[1:, None]
    weights = np.maximum(0.0, np.minimum(lower, upper))
    return weights * (2.0 / (edges[2:] - edges[:-2]))[:, None]


def _dct_matrix(n_in: int, n_out: int) -> npt.NDArray[np.float64]:
    """Orthonormal DCT-II as a ``[n_in, n_out]`` matrix: ``x @ D`` is
    ``scipy.fft.dct(x, norm="ortho")[:n_out]``."""
    n = np.arange(n_in)
    k = np.arange(n_out)
    d: npt.NDArray[np.float64] = np.cos(np.pi * k[None, :] * (2 * n[:, None] + 1) / (2 * n_in))
    d *= np.sqrt(2.0 / n_in)
    d[:, 0] /= np.sqrt(2.0)
    return d


@dataclass(frozen=True, kw_only=True)
class AudioFeatures:
    """The keyed features step's settings (see the module docstring)."""

    sample_rate: int = 16000
    column: str = "samples"
    n_fft: int = 400
    hop: int = 160
    n_mels: int = 40
    n_mfcc: int = 13
    fmin: float = 0.0
    fmax: float | None = None
    space: str = ""
    counters: MediaCounters = field(default_factory=lambda: MediaCounters("samples"), compare=False)

    def __post_init__(self) -> None:
        if not 0 < self.hop <= self.n_fft or self.n_fft < 2:
            raise ConfigError(f"need 0 < hop <= n_fft, n_fft >= 2; got n_fft={self.n_fft}, hop={self.hop}")
        if not 0 < self.n_mfcc <= self.n_mels:
            raise ConfigError(f"need 0 < n_mfcc <= n_mels, got {self.n_mfcc}, {self.n_mels}")

    @cached_property
    def _tables(self) -> tuple[npt.NDArray[np.float64], ...]:
        n = np.arange(self.n_fft)
        window = 0.5 - 0.5 * np.cos(2 * np.pi * n / self.n_fft)  # periodic Hann
        mel = mel_filters(self.sample_rate, self.n_fft, self.n_mels, self.fmin, self.fmax)
        return window, np.ascontiguousarray(mel.T), _dct_matrix(self.n_mels, self.n_mfcc)

    def state_columns(self) -> list[tuple[str, str, float]]:
        tail = [(f"tail_{j:04d}", "float32", 0.0) for j in range(self.n_fft - 1)]
        sums = [(f"sum_{j:02d}", "float64", 0.0) for j in range(self.n_mfcc)]
        squares = [(f"sq_{j:02d}", "float64", 0.0) for j in range(self.n_mfcc)]
        return [("tail_len", "int32", 0), ("frames", "int64", 0), *tail, *sums, *squares]

    def build(self, ctx: OperatorContext) -> Operator:
        return Stateful(self._update, self.space, tuple(self.state_columns())).build(ctx)

    def features(
        self, frames: npt.NDArray[np.float64]
    ) -> tuple[npt.NDArray[np.float64], npt.NDArray[np.float64]]:
        """``(log_mel, mfcc)`` of ``[frames, n_fft]`` samples."""
        window, mel, dct = self._tables
        spectrum = np.fft.rfft(frames * window, axis=1)
        power = spectrum.real**2 + spectrum.imag**2
        log_mel = 10.0 * np.log10(np.maximum(power @ mel, 1e-10))
        return log_mel, log_mel @ dct

    def _update(self, batch: Batch, state: StateView) -> Batch:
        took = time.perf_counter_ns()
        col = batch.column(self.column)
        offsets = col.offsets.to_numpy()
        values = col.values.to_numpy(zero_copy_only=False).astype(np.float32, copy=False)
        codes = batch.numpy(KEY)
        rows = len(codes)
        n_fft, hop = self.n_fft, self.hop
        tail_cols = [state.column(f"tail_{j:04d}") for j in range(n_fft - 1)]
        tail_len, done = state.column("tail_len"), state.column("frames")
        pieces: list[npt.NDArray[Any] | None] = [None] * rows  # each row's frames, in row order
        n_frames = np.zeros(rows, dtype=np.int64)
        first = np.zeros(rows, dtype=np.int64)
        for round_rows in state.rounds():
            keys = codes[round_rows]
            tails = np.stack([c[keys] for c in tail_cols], axis=1) if n_fft > 1 else None
            new_tails = np.zeros((len(keys), n_fft - 1), dtype=np.float32)
            for j, row in enumerate(round_rows.tolist()):
                key = keys[j]
                held = tails[j, : tail_len[key]] if tails is not None else np.zeros(0, np.float32)
                buf = np.concatenate([held, values[offsets[row] : offsets[row + 1]]])
                count = 0 if len(buf) < n_fft else 1 + (len(buf) - n_fft) // hop
                if count:
                    view = np.lib.stride_tricks.sliding_window_view(buf, n_fft)[: (count - 1) * hop + 1 : hop]
                    pieces[row] = view
                rest = buf[count * hop :]
                new_tails[j, : len(rest)] = rest
                tail_len[key] = len(rest)
                first[row] = done[key]
                done[key] += count
                n_frames[row] = count
            for i, c in enumerate(tail_cols):
                c[keys] = new_tails[:, i]
        made = [p for p in pieces if p is not None]
        frames = np.concatenate(made).astype(np.float64) if made else np.zeros((0, n_fft))
        log_mel, mfcc = self.features(frames)
        normed = self._normalise(mfcc, codes, n_frames, first, state)
        frame_offsets = np.zeros(rows + 1, dtype=np.int32)
        np.cumsum(n_frames, out=frame_offsets[1:])
        self.counters.add(
            items=rows,
            refused=0,
            nbytes=values.nbytes,
            decode_ns=time.perf_counter_ns() - took,
            units=len(values),
        )
        return batch.with_columns(
            {
                "log_mel": _frames_column(log_mel, frame_offsets),
                "mfcc": _frames_column(mfcc, frame_offsets),
                "mfcc_norm": _frames_column(normed, frame_offsets),
                "n_frames": n_frames,
                "first_frame": first,
            }
        )

    def _normalise(
        self,
        mfcc: npt.NDArray[np.float64],
        codes: npt.NDArray[np.int64],
        n_frames: npt.NDArray[np.int64],
        first: npt.NDArray[np.int64],
        state: StateView,
    ) -> npt.NDArray[np.float64]:
        """Each frame's MFCC less the running mean, over the running deviation, of its stream
        (every frame so far, this one included), row by row in order."""
        out = np.empty_like(mfcc)
        sums = [state.column(f"sum_{j:02d}") for j in range(self.n_mfcc)]
        squares = [state.column(f"sq_{j:02d}") for j in range(self.n_mfcc)]
        start = np.zeros(len(codes) + 1, dtype=np.int64)
        np.cumsum(n_frames, out=start[1:])
        for row in np.flatnonzero(n_frames).tolist():
            key, a, b = codes[row], start[row], start[row + 1]
            x = mfcc[a:b]
            count = (first[row] + np.arange(1, b - a + 1))[:, None]
            cum = np.array([c[key] for c in sums]) + np.cumsum(x, axis=0)
            cumq = np.array([c[key] for c in squares]) + np.cumsum(x * x, axis=0)
            mean = cum / count
            out[a:b] = (x - mean) / np.sqrt(np.maximum(cumq / count - mean * mean, 0.0) + 1e-8)
            for j in range(self.n_mfcc):
                sums[j][key], squares[j][key] = cum[-1, j], cumq[-1, j]
        return out


def _frames_column(values: npt.NDArray[np.float64], frame_offsets: npt.NDArray[np.int32]) -> pa.ListArray:
    width = values.shape[1] if values.ndim == 2 else 0
    flat = np.ascontiguousarray(values, dtype=np.float32).reshape(-1)
    return pa.ListArray.from_arrays(pa.array(frame_offsets * width), pa.array(flat))
