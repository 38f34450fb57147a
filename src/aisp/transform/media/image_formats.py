"""What an encoded image's header says, read without decoding it: format, size, where the image
ends, how many scans a JPEG has and how its EXIF says to turn it.

``image_info`` walks the file's structure, as a decoder would, rather than searching for
markers in its last bytes:

- a JPEG, marker segment by marker segment (each scan's entropy-coded data skipped to the next
  marker that is neither a stuffed byte nor a restart) up to its end-of-image marker; a PNG,
  chunk by chunk up to ``IEND``; a WebP, to the end its RIFF header gives. What follows the end
  is not the image: a phone's "motion photo" appends a video after the JPEG, some tools append
  metadata after ``IEND``; it is ignored. A file that stops before its end is truncated;
- a progressive JPEG's scans are counted as they are met: each scan makes the decoder pass over
  every coefficient of the image again, so a few hundred kilobytes of thousands of tiny scans
  take seconds to decode; past ``max_scans`` (default ``MAX_SCANS``) the image is refused from
  the header pass, before any decoding. Encoders write 1 (baseline) to about 10 (progressive);
- the EXIF orientation (tag 0x0112, 1 to 8) of a JPEG (``APP1``), a PNG (``eXIf``) or a WebP
  (``EXIF``) says how the camera was held; ``orient`` turns decoded pixels upright by it, as
  Pillow's ``ImageOps.exif_transpose`` does. A missing or unreadable EXIF is orientation 1.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from aisp.transform.media.common import MediaError

__all__ = ["MAX_SCANS", "ImageInfo", "image_info", "orient"]

MAX_SCANS = 256
"""The most scans a JPEG may have (libjpeg-turbo leaves it unlimited by default and suggests a
limit of a few hundred to applications that decode untrusted images)."""
MAX_SEGMENTS = 100_000
"""The most marker segments (JPEG) or chunks (PNG, WebP) a header pass walks: each costs a
step in Python, and real files have tens to a few thousand."""

_JPEG_SOF = frozenset(range(0xC0, 0xD0)) - {0xC4, 0xC8, 0xCC}
_SCAN_END = re.compile(rb"\xff[\x01-\xcf\xd8-\xfe]")  # a marker: not 00 (stuffed), RSTn or fill
_PNG = b"\x89PNG\r\n\x1a\n"
_BYTE_ORDERS: dict[bytes, Literal["little", "big"]] = {b"II": "little", b"MM": "big"}


@dataclass(frozen=True, slots=True)
class ImageInfo:
    """An encoded image's header: ``width`` and ``height`` as stored, ``end`` (the bytes of the
    image proper; what follows is ignored), ``scans`` (a JPEG's; 1 for the others) and the
    EXIF ``orientation`` (1: as stored)."""

    format: str
    width: int
    height: int
    end: int
    scans: int = 1
    orientation: int = 1

    @property
    def transposed(self) -> bool:
        """Whether turning the image upright swaps its width and height (orientations 5-8)."""
        return self.orientation >= 5

    def size(self, upright: bool = True) -> tuple[int, int]:
        """``(width, height)``, turned upright by the orientation unless ``upright`` is False."""
        if upright and self.transposed:
            return self.height, self.width
        return self.width, self.height


def _be(data: bytes, at: int, n: int) -> int:
    return int.from_bytes(data[at : at + n], "big")


def _le(data: bytes, at: int, n: int) -> int:
    return int.from_bytes(data[at : at + n], "little")


def _exif_orientation(tiff: bytes) -> int:
    """The orientation tag of an EXIF block's first IFD (a TIFF header, maybe after ``Exif\\0\\0``);
    1 when there is none or the block does not parse."""
    if tiff[:6] == b"Exif\x00\x00":
        tiff = tiff[6:]
    order = _BYTE_ORDERS.get(tiff[:2])
    if order is None or len(tiff) < 8:
        return 1
    ifd = int.from_bytes(tiff[4:8], order)
    if ifd + 2 > len(tiff):
        return 1
    count = int.from_bytes(tiff[ifd : ifd + 2], order)
    for k in range(min(count, 512)):
        at = ifd + 2 + 12 * k
        if at + 12 > len(tiff):
            break
        if int.from_bytes(tiff[at : at + 2], order) == 0x0112:
            value = int.from_bytes(tiff[at + 8 : at + 10], order)
            return value if 1 <= value <= 8 else 1
    return 1


def _jpeg(data: bytes, max_scans: int) -> ImageInfo:
    n = len(data)
    i, size, scans, orientation = 2, None, 0, 0
    for _ in range(MAX_SEGMENTS):
        if i + 2 > n:
            break
        if data[i] != 0xFF:
            raise MediaError("corrupt JPEG: no marker where one should be")
        marker = data[i + 1]
        if marker == 0xFF:  # fill byte
            i += 1
            continue
        if marker == 0xD9:
            if size is None:
                raise MediaError("corrupt JPEG: image data before its frame header")
            return ImageInfo("jpeg", size[0], size[1], i + 2, scans, orientation or 1)
        if marker == 0x01 or 0xD0 <= marker <= 0xD8:  # markers without a length
            i += 2
            continue
        if i + 4 > n:
            break
        length = _be(data, i + 2, 2)
        if length < 2:
            raise MediaError("corrupt JPEG: a segment shorter than its header")
        body, i = i + 4, i + 2 + length
        if marker in _JPEG_SOF and size is None:
            if body + 5 > n:
                break
            size = _be(data, body + 3, 2), _be(data, body + 1, 2)
        elif marker == 0xE1 and not orientation and data[body : body + 6] == b"Exif\x00\x00":
            orientation = _exif_orientation(data[body:i])
        elif marker == 0xDA:
            if size is None:
                raise MediaError("corrupt JPEG: image data before its frame header")
            scans += 1
            if scans > max_scans:
                raise MediaError(f"JPEG has too many scans: more than {max_scans} (limit {max_scans})")
            found = _SCAN_END.search(data, min(i, n))
            if found is None:
                break
            i = found.start()
    else:
        raise MediaError(f"JPEG has too many segments: more than {MAX_SEGMENTS}")
    if size is None:
        raise MediaError("truncated JPEG: ends before its frame header")
    raise MediaError("truncated JPEG: no end-of-image marker")


def _png(data: bytes) -> ImageInfo:
    n = len(data)
    if n < 24 or data[12:16] != b"IHDR":
        raise MediaError("truncated PNG: no image header")
    width, height = _be(data, 16, 4), _be(data, 20, 4)
    i, orientation = 8, 1
    for _ in range(MAX_SEGMENTS):
        if i + 12 > n:
            break
        length, kind = _be(data, i, 4), data[i + 4 : i + 8]
        end = i + 12 + length
        if end > n:
            break
        if kind == b"eXIf":
            orientation = _exif_orientation(data[i + 8 : end - 4])
        elif kind == b"IEND":
            return ImageInfo("png", width, height, end, 1, orientation)
        i = end
    else:
        raise MediaError(f"PNG has too many chunks: more than {MAX_SEGMENTS}")
    raise MediaError("truncated PNG: no end chunk")


def _webp(data: bytes) -> ImageInfo:
    if len(data) < 30:
        raise MediaError("truncated WebP: shorter than its headers")
    end = _le(data, 4, 4) + 8
    if end > len(data):
        raise MediaError("truncated WebP: shorter than its RIFF header says")
    chunk = data[12:16]
    if chunk == b"VP8 ":
        if data[23:26] != b"\x9d\x01\x2a":
            raise MediaError("corrupt WebP: bad VP8 frame tag")
        return ImageInfo("webp", _le(data, 26, 2) & 0x3FFF, _le(data, 28, 2) & 0x3FFF, end)
    if chunk == b"VP8L":
        if data[20] != 0x2F:
            raise MediaError("corrupt WebP: bad VP8L signature")
        bits = _le(data, 21, 4)
        return ImageInfo("webp", (bits & 0x3FFF) + 1, ((bits >> 14) & 0x3FFF) + 1, end)
    if chunk == b"VP8X":
        width, height = _le(data, 24, 3) + 1, _le(data, 27, 3) + 1
        orientation = _webp_orientation(data, end) if data[20] & 0x08 else 1
        return ImageInfo("webp", width, height, end, 1, orientation)
    raise MediaError(f"corrupt WebP: unknown chunk {chunk.decode('latin-1')!r}")


def _webp_orientation(data: bytes, end: int) -> int:
    """The orientation in an extended WebP's ``EXIF`` chunk."""
    i = 12
    for _ in range(MAX_SEGMENTS):
        if i + 8 > end:
            break
        size = _le(data, i + 4, 4)
        if data[i : i + 4] == b"EXIF":
            return _exif_orientation(data[i + 8 : min(end, i + 8 + size)])
        i += 8 + size + (size & 1)
    return 1


def image_info(data: bytes, *, max_scans: int = MAX_SCANS) -> ImageInfo:
    """An encoded image's header (see the module docstring); ``MediaError`` with the reason for
    an empty, truncated, corrupt or unsupported file or one of more than ``max_scans`` scans.

    >>> image_info(b"GIF89a...")
    Traceback (most recent call last):
    ...
    aisp.transform.media.common.MediaError: unsupported image format: GIF
    """
    if not data:
        raise MediaError("empty image (zero bytes)")
    if data[:3] == b"\xff\xd8\xff":
        info = _jpeg(data, max_scans)
    elif data[:8] == _PNG:
        info = _png(data)
    elif data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        info = _webp(data)
    else:
        for magic, name in ((b"GIF8", "GIF"), (b"BM", "BMP"), (b"II*\x00", "TIFF"), (b"MM\x00*", "TIFF")):
            if data.startswith(magic):
                raise MediaError(f"unsupported image format: {name}")
        raise MediaError("not an image: no JPEG, PNG or WebP signature")
    if info.width < 1 or info.height < 1:
        raise MediaError(f"corrupt {info.format.upper()}: {info.width} x {info.height} pixels")
    return info


def orient(img: np.ndarray[Any, Any], orientation: int) -> np.ndarray[Any, Any]:
    """Decoded pixels (``[height, width, ...]``) turned upright by an EXIF orientation, as
    ``PIL.ImageOps.exif_transpose`` turns them (a view: no pixel is copied)."""
    if orientation == 2:
        return img[:, ::-1]
    if orientation == 3:
        return img[::-1, ::-1]
    if orientation == 4:
        return img[::-1]
    if orientation == 5:
        return img.swapaxes(0, 1)
    if orientation == 6:
        return img[::-1].swapaxes(0, 1)
    if orientation == 7:
        return img[::-1, ::-1].swapaxes(0, 1)
    if orientation == 8:
        return img[:, ::-1].swapaxes(0, 1)
    return img
