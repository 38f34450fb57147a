"""Videos whose content is known, for the video checks, benchmark and example.

``make_video`` encodes frames with PyAV (FFmpeg's encoders: H.264 through libx264, VP9, MJPEG,
MPEG-4) into a container (MPEG-TS, MP4, Matroska/WebM, AVI) in memory, with an optional mono
audio track (AAC, Opus); each frame shows its number, or a caption given for its time, in large
letters (OpenCV's Hershey font) over a moving gradient, so what a decoder gives back can be
checked frame by frame and read back by OCR. ``frame_number`` reads the number a frame shows from
the block code in its top rows (no OCR needed: each bit a black or white block).
"""

from __future__ import annotations

import io
from collections.abc import Callable, Sequence
from fractions import Fraction
from typing import Any

import numpy as np
import numpy.typing as npt

__all__ = ["chunks", "frame_number", "make_video", "picture"]

_BITS = 16


def picture(i: int, width: int, height: int, text: str | None = None) -> npt.NDArray[np.uint8]:
    """Frame ``i``: a gradient that moves with ``i``, the number ``i`` in 16 blocks along the
    top (white is 1, most significant first) and ``text`` (default the number) in the middle."""
    import cv2

    x = np.arange(width, dtype=np.int32)[None, :]
    y = np.arange(height, dtype=np.int32)[:, None]
    img = np.empty((height, width, 3), np.uint8)
    img[..., 0] = ((x + 3 * i) % 256) // 2 + 32
    img[..., 1] = ((y + 2 * i) % 256) // 2 + 32
    img[..., 2] = 96
    block = width // _BITS
    bar = max(4, height // 12)
    for bit in range(_BITS):
        on = (i >> (_BITS - 1 - bit)) & 1
        img[:bar, bit * block : (bit + 1) * block] = 255 if on else 0
    label = str(i) if text is None else text
    scale = max(0.5, min(width / (22 * max(len(label), 1)), height / 40))
    thick = max(1, int(scale * 2))
    (tw, th), _ = cv2.getTextSize(label, cv2.FONT_HERSHEY_SIMPLEX, scale, thick)
    org = (max(0, (width - tw) // 2), (height + th) // 2)
    cv2.rectangle(img, (org[0] - 8, org[1] - th - 8), (org[0] + tw + 8, org[1] + 8), (255, 255, 255), -1)
    cv2.putText(img, label, org, cv2.FONT_HERSHEY_SIMPLEX, scale, (0, 0, 0), thick, cv2.LINE_AA)
    return img


def frame_number(rgb: npt.NDArray[np.uint8]) -> int:
    """The number ``picture`` coded along a frame's top (after lossy coding and scaling)."""
    height, width = rgb.shape[:2]
    block = width / _BITS
    bar = max(1, int(height / 12 / 2))
    n = 0
    for bit in range(_BITS):
        x0, x1 = int(bit * block + block / 4), int((bit + 1) * block - block / 4)
        n = n << 1 | int(rgb[: max(1, bar), x0 : max(x0 + 1, x1)].mean() > 128)
    return n


def make_video(
    frames: int,
    *,
    width: int = 320,
    height: int = 240,
    fps: int = 25,
    codec: str = "libx264",
    container: str = "mpegts",
    gop: int = 25,
    bframes: int = 0,
    audio: tuple[npt.NDArray[np.float32], int] | None = None,
    audio_codec: str = "aac",
    text: Callable[[int], str | None] | None = None,
) -> bytes:
    """A video of ``frames`` frames of ``picture`` at ``fps``, a key frame every ``gop``, as
    ``container`` bytes; ``audio``: (mono samples, rate) for its sound track; ``text(i)``: what
    frame ``i`` shows (None: its number)."""
    import av

    buf = io.BytesIO()
    out: Any
    with av.open(buf, "w", format=container) as out:
        video: Any = out.add_stream(codec, rate=fps)
        video.width, video.height = width, height
        video.pix_fmt = "yuvj420p" if codec == "mjpeg" else "yuv420p"
        video.codec_context.gop_size = gop
        if codec == "libx264":
            video.codec_context.options = {
                "preset": "ultrafast",
                "bf": str(bframes),
                "x264-params": f"keyint={gop}:min-keyint={gop}:scenecut=0:log-level=none",
            }
        sound: Any = None
        if audio is not None:
            sound = out.add_stream(audio_codec, rate=audio[1])
            sound.layout = "mono"
        for i in range(frames):
            frame = av.VideoFrame.from_ndarray(
                picture(i, width, height, text(i) if text else None), format="rgb24"
            )
            frame.pts = i
            frame.time_base = Fraction(1, fps)
            for packet in video.encode(frame):
                out.mux(packet)
        for packet in video.encode():
            out.mux(packet)
        if sound is not None and audio is not None:
            samples, rate = audio
            size = sound.codec_context.frame_size or 1024
            for at in range(0, len(samples), size):
                part = np.zeros((1, size), np.float32)
                piece = samples[at : at + size]
                part[0, : len(piece)] = piece
                af = av.AudioFrame.from_ndarray(part, format="fltp", layout="mono")
                af.sample_rate, af.pts, af.time_base = rate, at, Fraction(1, rate)
                for packet in sound.encode(af):
                    out.mux(packet)
            for packet in sound.encode():
                out.mux(packet)
    return buf.getvalue()


def chunks(data: bytes, cuts: Sequence[int]) -> list[bytes]:
    """``data`` cut at the offsets ``cuts`` (sorted, inside it)."""
    edges = [0, *cuts, len(data)]
    return [data[a:b] for a, b in zip(edges, edges[1:], strict=False) if b > a]
