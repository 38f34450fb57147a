"""Video decoding: containers, whole or as a live stream's chunks, into frames for the image steps.

``VideoDecode`` (``stream.apply("video", VideoDecode(fps=2))``) turns container bytes into one
row per frame it keeps: ``frame`` (the pixels, RGB24, ``frame_height`` x ``frame_width`` x 3
bytes; ``ImagePreprocess(column="frame", input="rgb24")`` makes tensors of them), ``pts_s`` (the
frame's time from the stream's start), ``frame_index`` (its place among the stream's decoded
frames) and ``keyframe``, besides the input row's other columns. It keeps every frame
(``fps=0``), ``fps`` frames a second of the stream's time (the first frame at or after each
multiple of ``1 / fps``, whatever the chunks), or key frames only (``keyframes=True``: the
others are not even decoded); ``size=(height, width)`` scales them in libswscale as they are
converted. With ``audio=True`` the audio track comes out too, on the step's ``"audio"`` port:
``samples`` (mono float32 at the track's own ``sample_rate``; a keyed ``Resample`` step takes it
to 16 kHz for the speech steps) and ``audio_start_s``.

Two kinds of input (FFmpeg decodes, through PyAV):

* ``stream=None``: each row is a whole file in any container FFmpeg reads (MP4, Matroska/WebM,
  MPEG-TS, AVI, ...). Its header is read first: a file with no video stream, a codec FFmpeg
  cannot decode, frames of more than ``max_pixels`` pixels, a frame rate over ``max_fps``, a
  duration over ``max_seconds`` or more than ``max_decoded_bytes`` of decoded pictures (frames x
  pixels x 1.5 for 4:2:0) is refused before any frame is decoded, and the decoders are opened
  with FFmpeg's own ``max_pixels`` so a header that lies is refused by the decoder too.
* ``stream="stream"`` (after ``key_by`` on that column): each row is the next chunk of one live
  MPEG transport stream, cut anywhere. Each stream's demuxer (``aisp.transform.media.mpegts``,
  whose state is bytes and numbers) and decoders carry from chunk to chunk, so a stream cut into
  chunks of any size gives the frames (pixels, times, indices) of the whole. A frame comes with
  the row whose bytes complete it (a video PES packet ends when the next starts, so one frame
  after). Each key frame's picture size is read from its parameter sets before it is decoded.
  The checkpoint (``snapshot`` / ``restore``) holds each stream's demuxer state and the packets
  since its last key frame: a restored stream decodes those again (their frames, made before the
  checkpoint, are not emitted twice) and goes on where it was. At the end of input the streams
  are flushed: their last frames come out.

Bad input never stops the step: an empty, truncated or corrupt container or chunk, lost or
damaged TS packets, an unsupported codec, a frame size or rate over its limit, or a decoder
error sends the row to the dead-letter sink with the reason; the other rows, and a stream's
other chunks, go on (a stream refused for its frame size or rate refuses its later chunks too:
its work is unbounded). Memory is bounded per row (``max_bytes`` in, ``max_decoded_bytes`` of
pictures made) and per stream (``max_gop_bytes`` of packets kept for a restore: a stream whose
key frames are further apart keeps none, and a restore then resumes at its next key frame).

Each stream's rows decode in order; different streams decode on one thread per core (FFmpeg's
decoders release the GIL). Counters: frames decoded and refused inputs, bytes, decode seconds
(``aisp_media_*{unit="frames"}``); ``aisp diagnose`` names ``decode_bound`` when they dominate.

Needs PyAV (``av``), which the ``speech`` extra brings (``pip install 'aisp[speech]'``).
"""

from __future__ import annotations

import hashlib
import io
import math
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any

import numpy as np
import numpy.typing as npt
import orjson
import pyarrow as pa

from aisp.batch import ID, SOURCE, Batch
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
)
from aisp.transform.media.mpegts import PACKET, Pes, TsDemuxer
from aisp.transform.operators import Emit, Operator, OperatorContext
from aisp.transform.windows.base import window_ids

__all__ = ["AUDIO_PORT", "FRAME_COLUMNS", "OverLimit", "VideoDecode"]

AUDIO_PORT = "audio"
FRAME_COLUMNS = ("frame_width", "frame_height", "pts_s", "frame_index", "keyframe")
"""The columns a frame row gets besides the pixels."""
_TICKS = 90_000  # MPEG-TS timestamps: 90 kHz
_MAX_STREAMS = 64
_WRAP = 1 << 33


def _av() -> Any:
    try:
        import av
    except ImportError as exc:  # pragma: no cover - the speech extra is part of the dev install
        raise ConfigError("video steps need PyAV: pip install 'aisp[speech]'") from exc
    return av


def _hash(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little") >> 1


def _keyframe(codec: str, payload: bytes, random_access: bool) -> bool:
    """Whether an access unit starts a picture the decoder needs nothing before: an IDR slice
    (H.264 NAL type 5) or an IRAP picture (HEVC types 16-23); other codecs: the TS packet's
    random access flag."""
    if codec not in ("h264", "hevc"):
        return random_access
    at = payload.find(b"\x00\x00\x01")
    while at != -1 and at + 3 < len(payload):
        head = payload[at + 3]
        kind = head & 0x1F if codec == "h264" else (head >> 1) & 0x3F
        if (codec == "h264" and kind == 5) or (codec == "hevc" and 16 <= kind <= 23):
            return True
        if codec == "h264" and 1 <= kind <= 4:
            return False  # a slice that is not IDR: the picture is not a key frame
        if codec == "hevc" and kind < 16:
            return False
        at = payload.find(b"\x00\x00\x01", at + 3)
    return False


class OverLimit(MediaError):
    """Input over one of the step's limits (frame size, frame rate, decoded bytes): a live
    stream that says so is refused from then on, as its work would be unbounded."""


def _says(exc: Exception) -> str:
    """What FFmpeg said, without PyAV's errno and the name of the call."""
    return plain(str(getattr(exc, "strerror", None) or exc))


def _mono(frame: Any) -> npt.NDArray[np.float32]:
    """An audio frame's samples mixed to mono float32 in [-1, 1]."""
    arr = frame.to_ndarray()
    channels = len(frame.layout.channels) or 1
    if not frame.format.is_planar:
        arr = arr.reshape(-1, channels).T
    name = frame.format.name.rstrip("p")
    if name == "s16":
        arr = arr.astype(np.float32) / 32768.0
    elif name == "s32":
        arr = arr.astype(np.float32) / 2147483648.0
    elif name == "u8":
        arr = (arr.astype(np.float32) - 128.0) / 128.0
    out: npt.NDArray[np.float32] = np.mean(arr, axis=0, dtype=np.float32)
    return out


@dataclass(frozen=True, kw_only=True)
class VideoDecode:
    """The video decoding step's settings (see the module docstring)."""

    column: str = "video"
    stream: str | None = None
    """The column naming each row's live stream (its rows are MPEG-TS chunks); None: each row
    is a whole file."""
    output: str = "frame"
    fps: float = 0.0
    """Frames a second of stream time to keep (0: every frame)."""
    keyframes: bool = False
    size: tuple[int, int] | None = None
    """(height, width) the kept frames are scaled to; None: as decoded."""
    audio: bool = False
    """The audio track as rows on the ``"audio"`` port too."""
    max_pixels: int = 4096 * 4096
    max_fps: float = 240.0
    max_seconds: float = 3600.0
    """The longest file (from its header); a live stream has no end."""
    max_bytes: int = 256 << 20
    """The largest input row (a file or a chunk)."""
    max_decoded_bytes: int = 4 << 30
    """Decoded pictures (frames x pixels x 1.5) an input row may make: a file's from its
    header before decoding; a chunk's as it decodes."""
    max_gop_bytes: int = 32 << 20
    """Packets since a stream's last key frame kept for a restore."""
    threads: int = 0
    counters: MediaCounters = field(default_factory=lambda: MediaCounters("frames"), compare=False)

    def __post_init__(self) -> None:
        if self.fps < 0 or self.max_fps <= 0:
            raise ConfigError(f"fps must be >= 0 and max_fps > 0, got {self.fps}, {self.max_fps}")
        if self.size is not None and (len(self.size) != 2 or min(self.size) < 1):
            raise ConfigError(f"size must be (height, width) >= 1 or None, got {self.size}")
        for name in ("max_pixels", "max_bytes", "max_decoded_bytes", "max_gop_bytes"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_seconds <= 0:
            raise ConfigError(f"max_seconds must be > 0, got {self.max_seconds}")

    @property
    def ports(self) -> tuple[str, ...]:
        return (DEFAULT_PORT, AUDIO_PORT) if self.audio else (DEFAULT_PORT,)

    def build(self, ctx: OperatorContext) -> Operator:
        return VideoDecodeOp(self, ctx)


class _Out:
    """What one input row made: frames (pixels, width, height, time, index, key) and audio."""

    __slots__ = ("audio", "audio_rate", "audio_start", "count", "decoded", "error", "frames", "nbytes")

    def __init__(self) -> None:
        self.frames: list[tuple[bytes, int, int, float, int, bool]] = []
        self.audio: list[npt.NDArray[np.float32]] = []
        self.audio_rate = 0
        self.audio_start = 0.0
        self.error: str | None = None
        self.decoded = 0  # bytes of pictures the decoder made for this row
        self.count = 0  # frames the decoder made for this row
        self.nbytes = 0


class _Picker:
    """Which decoded frames to keep, by their times (the same whatever the chunks)."""

    def __init__(self, spec: VideoDecode, next_at: float = 0.0, index: int = 0) -> None:
        self.spec = spec
        self.step = 1.0 / spec.fps if spec.fps else 0.0
        self.next_at = next_at
        self.index = index  # frames decoded so far

    def take(self, t: float, key: bool) -> bool:
        self.index += 1
        if self.spec.keyframes:
            return key
        if not self.step:
            return True
        if t + 1e-9 < self.next_at:
            return False
        self.next_at += self.step * (math.floor((t - self.next_at) / self.step + 1e-9) + 1)
        return True


class _Live:
    """One live stream's state: its demuxer, decoders, the video packets since its last key
    frame (for a restore) and where it is."""

    def __init__(self, spec: VideoDecode, name: str) -> None:
        self.spec, self.name = spec, name
        self.demux = TsDemuxer(max_pes_bytes=min(spec.max_bytes, 64 << 20))
        self.picker = _Picker(spec)
        self.vdec: Any = None
        self.adec: Any = None
        self.origin: int | None = None  # the first timestamp (90 kHz, unwrapped)
        self.last_ts = 0  # the last timestamp seen, unwrapped (for 33-bit wrap-around)
        self.shown = -1  # the latest frame time output by the decoder (unwrapped ticks)
        self.gop: list[tuple[int | None, int | None, bytes]] = []  # packets since the last key frame
        self.gop_bytes = 0
        self.key_at = -1  # where in gop the latest key frame is (-1: none kept)
        self.key_pts: int | None = None
        self.replay = False  # gop holds what a restored decoder must decode first
        self.last_audio: bytes = b""  # the last audio packet (an AAC frame overlaps the one before)
        self.audio_samples = 0  # audio samples output so far
        self.audio_origin: int | None = None
        self.refused: str | None = None  # why every later chunk is refused
        self.frame_times: list[int] = []  # recent frame times, for the rate limit
        self.told = False  # an unsupported audio codec was reported
        self.vcodec = ""  # the video decoder's codec (a restored stream's, to open it again)
        self.acodec = ""

    # -- timestamps ---------------------------------------------------------------------------
    def unwrap(self, ts: int | None) -> int | None:
        if ts is None:
            return None
        base = self.last_ts - (self.last_ts % _WRAP)
        best = min((base + ts + k * _WRAP for k in (-1, 0, 1)), key=lambda v: abs(v - self.last_ts))
        self.last_ts = best
        if self.origin is None:
            self.origin = best
        return best

    # -- decoders ---------------------------------------------------------------------------------
    def _decoder(self, kind: str, name: str) -> Any:
        av = _av()
        try:
            ctx = av.CodecContext.create(name, "r")
        except (av.FFmpegError, ValueError) as exc:
            raise MediaError(f"unsupported {kind} codec: {name} ({_says(exc)})") from None
        ctx.thread_count = 1  # streams decode in parallel; a decoder's own threads add latency
        if kind == "video":
            ctx.options = {"max_pixels": str(self.spec.max_pixels)}
            if self.spec.keyframes:
                ctx.skip_frame = "NONKEY"
        return ctx

    def _video(self, out: _Out) -> Any:
        if self.vdec is None:
            self.vdec = self._decoder("video", self.vcodec)
            if self.replay:  # a restored stream: its decoder sees the packets kept for it again
                self.replay = False
                for pts, dts, data in self.gop:
                    for frame in self._send(self.vdec, pts, dts, data):
                        self._frame(frame, out)  # those shown before the checkpoint are skipped
        return self.vdec

    def _audio(self, codec: str) -> Any:
        if self.adec is not None and self.acodec != codec:  # the programme map changed codec
            self.adec, self.last_audio = None, b""
        if self.adec is None:
            self.acodec = codec
            self.adec = self._decoder("audio", codec)
            if self.last_audio:
                self._send(self.adec, None, None, self.last_audio)  # its frames were output
        return self.adec

    @staticmethod
    def _send(ctx: Any, pts: int | None, dts: int | None, data: bytes | None) -> list[Any]:
        av = _av()
        packet = av.Packet(data) if data is not None else None
        if packet is not None:
            packet.pts, packet.dts = pts, dts
            packet.time_base = Fraction(1, _TICKS)
        try:
            return list(ctx.decode(packet))
        except av.FFmpegError as exc:
            raise MediaError(f"corrupt video: the decoder refused a packet ({_says(exc)})") from None

    def _size_check(self, codec: str, payload: bytes) -> None:
        """A key frame's picture size from its parameter sets (FFmpeg's parser), before decoding."""
        av = _av()
        parser = av.CodecContext.create(codec, "r")
        try:
            parser.parse(payload)
            parser.parse(None)
        except av.FFmpegError:
            return  # the decoder says what is wrong
        w, h = int(parser.width or 0), int(parser.height or 0)
        if w * h > self.spec.max_pixels:
            raise OverLimit(f"video frame too large: {w} x {h} pixels (limit {self.spec.max_pixels})")

    # -- chunks in ----------------------------------------------------------------------------------
    def feed(self, data: bytes | None, out: _Out, end: bool = False) -> None:
        """Demux and decode a chunk (``end``: the stream's end, its last frames), into ``out``."""
        if self.refused is not None:
            out.error = self.refused
            return
        packets: list[Pes] = []
        errors: list[str] = []
        if data:
            got, errors = self.demux.feed(data)
            packets += got
        if end:
            got, more = self.demux.finish()
            packets += got
            errors += more
        if self.demux.pmt_seen and "video" not in self.demux.codecs:
            code = self.demux.unsupported.get("video")
            what = f"unsupported video codec: MPEG-TS stream type 0x{code:02x}" if code else "no video stream"
            self.refused = f"stream refused: {what}"
            errors.append(self.refused)
        elif self.spec.audio and "audio" in self.demux.unsupported and not self.told:
            self.told = True
            errors.append(
                f"unsupported audio codec: MPEG-TS stream type 0x{self.demux.unsupported['audio']:02x}"
            )
        try:
            for pes in packets:
                if pes.kind == "video":
                    self._video_packet(pes, out)
                elif self.spec.audio:
                    self._audio_packet(pes, out)
            if end:
                if self.vdec is not None or self.replay:
                    for frame in self._send(self._video(out), None, None, None):
                        self._frame(frame, out)
                if self.adec is not None:
                    for frame in self._send(self.adec, None, None, None):
                        self._audio_frame(frame, out)
        except OverLimit as exc:
            errors.append(str(exc))
            self.refused = f"stream refused earlier: {exc}"
        except MediaError as exc:
            errors.append(str(exc))
        if errors:
            out.error = "; ".join(dict.fromkeys(errors))

    def _video_packet(self, pes: Pes, out: _Out) -> None:
        pts, dts = self.unwrap(pes.pts), self.unwrap(pes.dts)
        key = _keyframe(pes.codec, pes.payload, pes.random_access)
        if pes.codec != self.vcodec:  # the programme map changed the codec: start again
            self.vdec, self.replay, self.gop, self.gop_bytes, self.key_at = None, False, [], 0, -1
        if self.vdec is None and not self.replay and not key:
            return  # a decoder starts at a key frame (a stream joined mid-way, or kept no packets)
        self.vcodec = pes.codec
        decoder = self._video(out)
        if key:
            self._size_check(pes.codec, pes.payload)
            if not self.gop:
                self.gop_bytes = 0
            # the packets before a key frame are kept until the decoder has shown it: frames it
            # holds back for reordering may still be those of the packets before it
            self.key_at, self.key_pts = len(self.gop), pts
        if self.gop_bytes + len(pes.payload) <= self.spec.max_gop_bytes and (key or self.gop):
            self.gop.append((pts, dts, pes.payload))
            self.gop_bytes += len(pes.payload)
        else:  # too far from a key frame to keep: a restore resumes at the next one
            self.gop, self.gop_bytes, self.key_at = [], 0, -1
        for frame in self._send(decoder, pts, dts, pes.payload):
            self._frame(frame, out)
        if self.key_at > 0 and self.key_pts is not None and self.shown >= self.key_pts:
            dropped = self.gop[: self.key_at]
            self.gop = self.gop[self.key_at :]
            self.gop_bytes -= sum(len(d) for _, _, d in dropped)
            self.key_at = 0

    def _frame(self, frame: Any, out: _Out) -> None:
        spec = self.spec
        t = frame.pts if frame.pts is not None else self.shown + 1
        if t <= self.shown:
            return  # made before a restore (or out of order): already output
        self.shown = t
        out.decoded += frame.width * frame.height * 3 // 2
        out.count += 1
        if out.decoded > spec.max_decoded_bytes:
            raise OverLimit(f"decoded pictures over {spec.max_decoded_bytes} bytes for one chunk")
        self.frame_times.append(t)
        if len(self.frame_times) > spec.max_fps + 1:
            del self.frame_times[0]
            if self.frame_times[-1] - self.frame_times[0] < _TICKS:
                raise OverLimit(f"video frame rate over {spec.max_fps} frames a second of stream time")
        origin = self.origin if self.origin is not None else t
        seconds = (t - origin) / _TICKS
        index = self.picker.index
        if self.picker.take(seconds, bool(frame.key_frame)):
            out.frames.append((*_pixels(frame, spec.size), seconds, index, bool(frame.key_frame)))

    def _audio_packet(self, pes: Pes, out: _Out) -> None:
        pts = self.unwrap(pes.pts)
        if self.audio_origin is None and pts is not None:
            self.audio_origin = pts
        frames = self._send(self._audio(pes.codec), pts, None, pes.payload)
        self.last_audio = pes.payload
        for frame in frames:
            self._audio_frame(frame, out)

    def _audio_frame(self, frame: Any, out: _Out) -> None:
        samples = _mono(frame)
        if not out.audio:
            origin = self.origin if self.origin is not None else (self.audio_origin or 0)
            start = ((self.audio_origin or origin) - origin) / _TICKS
            out.audio_start = start + self.audio_samples / frame.sample_rate
            out.audio_rate = frame.sample_rate
        if frame.sample_rate != out.audio_rate:
            raise MediaError(f"audio sample rate changed mid-stream: {out.audio_rate} -> {frame.sample_rate}")
        out.audio.append(samples)
        self.audio_samples += len(samples)

    # -- checkpoints -----------------------------------------------------------------------------
    def state(self) -> tuple[bytes, bytes]:
        meta, blob = self.demux.state()
        gop = b"".join(d for _, _, d in self.gop)
        record = {
            "demux": meta,
            "demux_bytes": len(blob),
            "gop": [[p, d, len(data)] for p, d, data in self.gop],
            "key_at": self.key_at,
            "key_pts": self.key_pts,
            "last_audio": len(self.last_audio),
            "origin": self.origin,
            "last_ts": self.last_ts,
            "shown": self.shown,
            "next_at": self.picker.next_at,
            "index": self.picker.index,
            "audio_samples": self.audio_samples,
            "audio_origin": self.audio_origin,
            "refused": self.refused,
            "vcodec": self.vcodec,
            "acodec": self.acodec,
            "frame_times": self.frame_times,
        }
        return orjson.dumps(record), blob + gop + self.last_audio

    @classmethod
    def from_state(cls, spec: VideoDecode, name: str, meta_bytes: bytes, blob: bytes) -> _Live:
        s = cls(spec, name)
        meta = orjson.loads(meta_bytes)
        at = int(meta["demux_bytes"])
        s.demux = TsDemuxer.from_state(meta["demux"], blob[:at], s.demux.max_pes_bytes)
        for pts, dts, size in meta["gop"]:
            s.gop.append((pts, dts, blob[at : at + size]))
            s.gop_bytes += size
            at += size
        s.last_audio = blob[at : at + int(meta["last_audio"])]
        s.replay = bool(s.gop)
        s.key_at, s.key_pts = int(meta["key_at"]), meta["key_pts"]
        s.origin, s.last_ts, s.shown = meta["origin"], int(meta["last_ts"]), int(meta["shown"])
        s.picker = _Picker(spec, float(meta["next_at"]), int(meta["index"]))
        s.audio_samples, s.audio_origin = int(meta["audio_samples"]), meta["audio_origin"]
        s.refused, s.frame_times = meta["refused"], list(meta["frame_times"])
        s.vcodec, s.acodec = str(meta["vcodec"]), str(meta["acodec"])
        return s


def _pixels(frame: Any, size: tuple[int, int] | None) -> tuple[bytes, int, int]:
    """A video frame as RGB24 bytes (scaled to ``size`` in libswscale), its width and height."""
    if size is None:
        rgb = frame.to_ndarray(format="rgb24")
    else:
        rgb = frame.reformat(width=size[1], height=size[0], format="rgb24").to_ndarray()
    return rgb.tobytes(), int(rgb.shape[1]), int(rgb.shape[0])


def _decode_file(spec: VideoDecode, data: bytes, out: _Out) -> None:
    """A whole file's frames (and audio) into ``out``, its header checked first."""
    if len(data) > PACKET and data[0] == data[PACKET] == 0x47:
        # a transport stream: through the live streams' demuxer, which reads each key frame's
        # size before decoding it (FFmpeg's finds its streams by decoding the first frames)
        live = _Live(spec, "")
        live.feed(data, out, end=True)
        if out.error is None and not live.picker.index:
            out.error = "no frames: the video stream is empty or truncated"
        if out.error is not None:
            raise MediaError(out.error)
        return
    with _open(spec, data) as container:
        _File(spec, container, out).decode()


def _open(spec: VideoDecode, data: bytes) -> Any:
    av = _av()
    guard = {"max_pixels": str(spec.max_pixels)}  # the decoders FFmpeg opens to find the streams
    try:
        return av.open(io.BytesIO(data), mode="r", stream_options=[guard] * _MAX_STREAMS)
    except av.FFmpegError as exc:
        raise MediaError(f"not a video file FFmpeg reads: {_says(exc)}") from None
    except ValueError:  # PyAV: the format's streams are found by decoding (MPEG program streams)
        raise MediaError(
            "unsupported container: its streams are found only by decoding them (send MPEG-TS, "
            f"MP4, Matroska/WebM or AVI), or more than {_MAX_STREAMS} streams"
        ) from None


class _File:
    """One file's decoding: its header checked, then its frames picked and checked as they come."""

    def __init__(self, spec: VideoDecode, container: Any, out: _Out) -> None:
        self.spec, self.container, self.out = spec, container, out
        if not container.streams.video:
            raise MediaError("no video stream in the file")
        self.video = container.streams.video[0]
        self.seconds, self.rate = self._header()
        self.picker = _Picker(spec)
        # times are from the file's start (its earliest stream's first timestamp), as a live
        # stream's are from its first
        self.origin: float | None = container.start_time / 1e6 if container.start_time is not None else None
        self.first: float | None = None
        self.shown = -math.inf
        self.frame_times: list[float] = []

    def _header(self) -> tuple[float, float]:
        spec, video = self.spec, self.video
        ctx = video.codec_context
        if ctx is None or not ctx.name or ctx.name == "none":
            raise MediaError("unsupported video codec: FFmpeg has no decoder for it")
        w, h = int(ctx.width or 0), int(ctx.height or 0)
        if w * h > spec.max_pixels:
            raise OverLimit(f"video frame too large: {w} x {h} pixels (limit {spec.max_pixels})")
        if w * h == 0:
            raise MediaError("corrupt video: no picture size in the header")
        rate = float(video.average_rate or video.guessed_rate or 0)
        if rate > spec.max_fps:
            raise OverLimit(f"video frame rate over {spec.max_fps}: {rate:.1f} frames a second")
        seconds = (
            float(video.duration * video.time_base)
            if video.duration and video.time_base
            else (self.container.duration or 0) / 1e6
        )
        if seconds > spec.max_seconds:
            raise MediaError(f"video too long: {seconds:.1f} s (limit {spec.max_seconds})")
        frames = video.frames or math.ceil(seconds * (rate or spec.max_fps))
        if frames * w * h * 3 // 2 > spec.max_decoded_bytes:
            raise OverLimit(
                f"decoded pictures over {spec.max_decoded_bytes} bytes: {frames} frames of {w} x {h}"
            )
        if spec.keyframes:
            ctx.skip_frame = "NONKEY"
        ctx.thread_count = 1
        return seconds, rate

    def decode(self) -> None:
        av, video, out = _av(), self.video, self.out
        streams = [video]
        audio = self.container.streams.audio[0] if self.spec.audio and self.container.streams.audio else None
        if audio is not None:
            streams.append(audio)
        packets, last = 0, -math.inf  # the video packets demuxed (all, even those not decoded), the last time
        try:
            for packet in self.container.demux(*streams):
                if packet.stream is video and packet.size:
                    packets += 1
                    if packet.pts is not None and packet.time_base:
                        last = max(last, float(packet.pts * packet.time_base))
                for frame in packet.decode():
                    if packet.stream is not audio:
                        self._frame(frame)
                        continue
                    if not out.audio:
                        out.audio_rate = frame.sample_rate
                        out.audio_start = float(frame.time or 0.0) - (self.origin or 0.0)
                    out.audio.append(_mono(frame))
        except av.FFmpegError as exc:
            raise MediaError(f"corrupt video: {_says(exc)}") from None
        if self.picker.index == 0:
            raise MediaError("no frames: the video stream is empty or truncated")
        _whole(video.frames, packets, self.seconds, self.rate, last - (self.first or 0))

    def _frame(self, frame: Any) -> None:
        spec, out = self.spec, self.out
        t = float(frame.time) if frame.time is not None else self.shown + 1e-6
        if t <= self.shown:
            return
        self.shown = t
        origin = self.origin = t if self.origin is None else self.origin
        self.first = t if self.first is None else self.first
        out.decoded += frame.width * frame.height * 3 // 2
        out.count += 1
        if out.decoded > spec.max_decoded_bytes:
            raise OverLimit(f"decoded pictures over {spec.max_decoded_bytes} bytes")
        if frame.width * frame.height > spec.max_pixels:
            raise OverLimit(
                f"video frame too large: {frame.width} x {frame.height} pixels (limit {spec.max_pixels})"
            )
        self.frame_times.append(t)
        if len(self.frame_times) > spec.max_fps + 1:
            del self.frame_times[0]
            if self.frame_times[-1] - self.frame_times[0] < 1.0:
                raise OverLimit(f"video frame rate over {spec.max_fps} frames a second")
        if t - origin > spec.max_seconds:
            raise MediaError(f"video too long: over {spec.max_seconds} s")
        index = self.picker.index
        if self.picker.take(t - origin, bool(frame.key_frame)):
            out.frames.append((*_pixels(frame, spec.size), t - origin, index, bool(frame.key_frame)))


def _whole(frames: int, packets: int, seconds: float, rate: float, span: float) -> None:
    """Refuse a file cut short: fewer frames (packets) than the header counts (one allowed
    for), or a last frame well before the header's duration."""
    if frames and packets + 1 < frames:
        raise MediaError(f"truncated video: {packets} of the {frames} frames its header counts")
    if not frames and seconds and rate and span + 2 / rate < seconds * 0.98:
        raise MediaError(f"truncated video: frames up to {span:.2f} s of the {seconds:.2f} s its header says")


class VideoDecodeOp:
    """The running video step."""

    def __init__(self, spec: VideoDecode, ctx: OperatorContext) -> None:
        self.spec, self.ctx = spec, ctx
        self.streams: dict[str, _Live] = {}
        self._threads = spec.threads or cores()
        self._lock = threading.Lock()

    def process(self, batch: Batch) -> Emit:
        spec = self.spec
        payloads = binary_payloads(batch, spec.column)
        if spec.stream is not None and spec.stream not in batch.column_names:
            raise ConfigError(f"video decoding by stream needs the column {spec.stream!r}")
        names = batch.column(spec.stream).to_pylist() if spec.stream is not None else None
        outs = [_Out() for _ in payloads]
        # the rows of one stream in order, on one thread; different streams on different threads
        groups: dict[Any, list[int]] = {}
        for i in range(len(payloads)):
            groups.setdefault(names[i] if names is not None else i, []).append(i)
        order = list(groups.values())

        def work(start: int, end: int) -> int:
            took = time.perf_counter_ns()
            for rows in order[start:end]:
                for i in rows:
                    self._row(payloads[i], names[i] if names is not None else None, outs[i])
            return time.perf_counter_ns() - took

        spent = run_sliced(self._threads, len(order), work, min_rows=1)
        return self._emit(batch, outs, sum(spent))

    def _row(self, data: bytes | None, name: str | None, out: _Out) -> None:
        out.nbytes = len(data or b"")
        try:
            self._decode(data, name, out)
        except MediaError as exc:
            out.error = str(exc)
        if out.error is not None and self.spec.stream is None:
            out.frames, out.audio = [], []  # a file is decoded whole or not at all

    def _decode(self, data: bytes | None, name: str | None, out: _Out) -> None:
        spec = self.spec
        if data is None:
            raise MediaError("no video (null)")
        if not data:
            raise MediaError("empty video (zero bytes)")
        if len(data) > spec.max_bytes:
            raise MediaError(f"video input too large: {len(data)} bytes (limit {spec.max_bytes})")
        if spec.stream is None:
            _decode_file(spec, data, out)
            return
        if name is None:
            raise MediaError(f"no stream id (column {spec.stream!r} is null)")
        with self._lock:
            live = self.streams.get(name)
            if live is None:
                live = self.streams[name] = _Live(spec, name)
        live.feed(data, out)

    def _emit(self, batch: Batch | None, outs: Sequence[_Out], decode_ns: int) -> Emit:
        spec = self.spec
        bad = [(i, o.error) for i, o in enumerate(outs) if o.error is not None]
        spec.counters.add(
            items=len(outs) - len(bad),
            refused=len(bad),
            nbytes=sum(o.nbytes for o in outs),
            decode_ns=decode_ns,
            units=sum(o.count for o in outs),
        )
        if bad and batch is not None:
            dead_letter_rows(self.ctx, batch, bad)
        emit: Emit = []
        frames = self._frames(batch, outs)
        if frames is not None:
            emit.append((DEFAULT_PORT, frames))
        if spec.audio:
            audio = self._audio(batch, outs)
            if audio is not None:
                emit.append((AUDIO_PORT, audio))
        return emit

    def _frames(self, batch: Batch | None, outs: Sequence[_Out]) -> Batch | None:
        spec = self.spec
        rows = np.array([i for i, o in enumerate(outs) for _ in o.frames], dtype=np.int64)
        if not len(rows):
            return None
        made = [f for o in outs for f in o.frames]
        cols: dict[str, Any] = {
            spec.output: pa.array([f[0] for f in made], pa.binary()),
            "frame_width": np.array([f[1] for f in made], dtype=np.int64),
            "frame_height": np.array([f[2] for f in made], dtype=np.int64),
            "pts_s": np.array([f[3] for f in made], dtype=np.float64),
            "frame_index": np.array([f[4] for f in made], dtype=np.int64),
            "keyframe": np.array([f[5] for f in made], dtype=bool),
        }
        return self._rows(batch, rows, cols, cols["frame_index"])

    def _audio(self, batch: Batch | None, outs: Sequence[_Out]) -> Batch | None:
        rows = np.array([i for i, o in enumerate(outs) if o.audio], dtype=np.int64)
        if not len(rows):
            return None
        samples = [np.concatenate(outs[i].audio) for i in rows]
        offsets = np.zeros(len(samples) + 1, dtype=np.int32)
        np.cumsum([len(s) for s in samples], out=offsets[1:])
        rates = np.array([outs[i].audio_rate for i in rows], dtype=np.int64)
        starts = np.array([outs[i].audio_start for i in rows], dtype=np.float64)
        cols: dict[str, Any] = {
            "samples": pa.ListArray.from_arrays(pa.array(offsets), pa.array(np.concatenate(samples))),
            "sample_rate": rates,
            "audio_start_s": starts,
        }
        # an audio row's id: its stream (or file) and the sample it starts at, so a replay repeats it
        first = np.round(starts * rates).astype(np.int64)
        return self._rows(batch, rows, cols, first + (1 << 40))

    def _rows(
        self,
        batch: Batch | None,
        rows: npt.NDArray[np.int64],
        cols: dict[str, Any],
        serial: npt.NDArray[np.int64],
    ) -> Batch:
        spec = self.spec
        if batch is not None:
            keep = [c for c in batch.column_names if c != spec.column and c not in cols]
            taken = batch.select(keep).take(rows)
            if SOURCE not in taken.column_names and ID in taken.column_names:
                cols[SOURCE] = taken.column(ID)  # the event a row comes from: the chunk or file's
            out = taken.with_columns(cols)
        else:
            out = Batch.from_columns(cols)
        if spec.stream is not None:
            names = out.column(spec.stream).to_pylist()
            base = np.array([_hash(str(n)) for n in names], dtype=np.int64)
        elif batch is not None and ID in batch.column_names:
            base = batch.numpy(ID)[rows]
        else:
            base = rows
        return out.with_columns({ID: window_ids(np.asarray(base, dtype=np.int64), serial)})

    def flush(self) -> Emit:
        """The end of input: every live stream's last frames (and audio)."""
        if self.spec.stream is None or not self.streams:
            return []
        names = list(self.streams)
        outs = [_Out() for _ in names]
        took = time.perf_counter_ns()
        for name, out in zip(names, outs, strict=True):
            self.streams[name].feed(None, out, end=True)
        self.streams = {}
        for out in outs:
            out.error = None  # the end's damage belongs to no row (a truncated last packet)
        batch = Batch.from_columns({self.spec.stream: pa.array(names, pa.string())})
        return self._emit(batch, outs, time.perf_counter_ns() - took)

    # -- checkpoints --------------------------------------------------------------------------------
    def snapshot(self) -> dict[str, npt.NDArray[Any]]:
        items = list(self.streams.items())
        states = [s.state() for _, s in items]
        return {
            "__stream": np.array([n for n, _ in items], dtype=object),
            "__meta": np.array([m for m, _ in states], dtype=object),
            "__bytes": np.array([b for _, b in states], dtype=object),
        }

    def restore(self, columns: Mapping[str, npt.NDArray[Any]]) -> None:
        self.streams = {}
        for i, name in enumerate(columns.get("__stream", [])):
            self.streams[str(name)] = _Live.from_state(
                self.spec, str(name), bytes(columns["__meta"][i]), bytes(columns["__bytes"][i])
            )
