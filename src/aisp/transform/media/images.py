"""Image preprocessing as one step: encoded images (a binary column) in, model-ready tensors out.

``ImagePreprocess`` (``stream.images("prep", ImagePreprocess(size=(224, 224)))``) takes each
row's bytes (JPEG, PNG or WebP) from a binary column, as files, HTTP bodies and broker messages
bring them, or from a text column of base64, as JSON carries them, and makes one tensor per row:

- the header is read first, without decoding (``aisp.transform.media.image_formats``): an empty,
  truncated or corrupt file, a format other than those, an image of more than ``max_pixels``
  pixels (a decompression bomb: a few kilobytes that would decode to gigabytes) or a JPEG of
  more than ``max_scans`` scans (seconds of decoding for a few hundred kilobytes) is refused
  before any pixel is made, and the row goes to the dead-letter sink with the reason; the other
  rows go on. Bytes after the image's end (a motion photo's video) are ignored;
- each image is turned upright by its EXIF orientation (``exif_orientation=False``: as stored);
- libjpeg-turbo (JPEG, through simplejpeg) and OpenCV (PNG, WebP; resizing) work without the
  GIL, on one thread per core (``aisp.transform.media.common.run_sliced``): each thread takes a
  contiguous slice of the batch and writes its rows straight into the batch's tensor;
- ``fit`` makes every image ``size`` (height, width): ``letterbox`` keeps the aspect ratio and
  pads (with ``pad_value``), ``crop`` keeps it and cuts the centre, ``stretch`` does not keep it;
- ``color`` (``RGB``, ``BGR`` or ``GRAY``), then ``(pixel * scale - mean) / std`` per channel to
  float32 (or the pixels as they are with ``dtype="uint8"``), laid out ``NCHW`` or ``NHWC``.

With ``input="rgb24"`` the rows are pixels already decoded, as ``VideoDecode`` makes a video's
frames (``column="frame"``; each row's size in ``frame_width`` and ``frame_height``): they are
checked against ``max_pixels`` and their size, then fitted and normalised as above.

The tensor is a fixed-size-list column (``output``), the form an infer step reads as a model
input; with it each row gets where its pixels came from, so a model's boxes map back to the
original image: ``image_height`` and ``image_width`` (the original size, upright) and ``image_scale_x``,
``image_scale_y``, ``image_offset_x``, ``image_offset_y`` (tensor x = x * scale_x + offset_x).
The step's ``counters`` count images, bytes, decode seconds and pixels (``/metrics``).

Needs the ``media`` extra (``pip install 'aisp[media]'``).
"""

from __future__ import annotations

import base64
import binascii
import math
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt
import pyarrow as pa

from aisp.batch import Batch
from aisp.errors import ConfigError
from aisp.graph import DEFAULT_PORT
from aisp.transform.media.common import MediaCounters, MediaError, cores, dead_letter_rows, plain, run_sliced
from aisp.transform.media.image_formats import MAX_SCANS, ImageInfo, image_info, orient
from aisp.transform.operators import Emit, Operator, OperatorContext

__all__ = [
    "ImageBuckets",
    "ImageInfo",
    "ImagePreprocess",
    "MediaError",
    "decode_image",
    "image_header",
    "image_info",
]

_FITS = ("letterbox", "crop", "stretch")


def _cv2() -> Any:
    try:
        import cv2
    except ImportError as exc:  # pragma: no cover - the media extra is part of the dev install
        raise ConfigError("image steps need OpenCV: pip install 'aisp[media]'") from exc
    return cv2


def image_header(data: bytes) -> tuple[str, int, int]:
    """``(format, width, height)`` (as stored) read from an encoded image's header, without
    decoding it; a truncated JPEG (no end marker), PNG (no end chunk) or WebP (shorter than its
    RIFF size) is refused here too (``image_info`` says more: the end, scans, orientation).

    >>> image_header(b"GIF89a...")
    Traceback (most recent call last):
    ...
    aisp.transform.media.common.MediaError: unsupported image format: GIF
    """
    info = image_info(data)
    return info.format, info.width, info.height


def _payload(data: bytes | str | None, max_bytes: int) -> bytes:
    """A row's image bytes (a text column holds them as base64, as JSON carries them)."""
    if data is None:
        raise MediaError("no image (null)")
    if isinstance(data, str):
        try:
            data = base64.b64decode(data, validate=True)
        except (binascii.Error, ValueError) as exc:
            raise MediaError(f"not base64: {plain(str(exc))}") from None
    if len(data) > max_bytes:
        raise MediaError(f"image too large: {len(data)} bytes (limit {max_bytes})")
    return data


def decode_image(
    data: bytes,
    *,
    max_pixels: int = 40_000_000,
    color: str = "RGB",
    at_least: tuple[int, int] = (0, 0),
    max_scans: int = MAX_SCANS,
    exif_orientation: bool = True,
    info: ImageInfo | None = None,
) -> npt.NDArray[np.uint8]:
    """One image as ``uint8`` ``[height, width, channels]`` (``GRAY``: ``[height, width]``),
    checked as ``ImagePreprocess`` checks it; raises ``MediaError`` with the reason.

    A JPEG is decoded by libjpeg-turbo (``simplejpeg``) in strict mode, so corrupt data is an
    error rather than a grey band, and at the smallest of its DCT scales (1/2, 1/4, 1/8) that
    is still ``at_least`` (height, width, upright): a large photo for a small tensor decodes a
    fraction of its pixels. PNG and WebP are decoded by OpenCV. Bytes after the image's end
    are ignored. With ``exif_orientation`` the pixels are turned upright by the image's EXIF
    orientation (``ImageInfo.size()`` is then their size). ``info``: the header, if read already."""
    if info is None:
        info = image_info(data, max_scans=max_scans)
    if info.width * info.height > max_pixels:
        raise MediaError(f"image too large: {info.width} x {info.height} pixels (limit {max_pixels})")
    turn = info.orientation if exif_orientation else 1
    need = at_least[::-1] if turn >= 5 else at_least
    img = _decode_jpeg(data, info, color, need) if info.format == "jpeg" else _decode_cv(data, info, color)
    if turn == 1:
        return img
    return np.ascontiguousarray(orient(img, turn))


def _decode_jpeg(
    data: bytes, info: ImageInfo, color: str, at_least: tuple[int, ...]
) -> npt.NDArray[np.uint8]:
    import simplejpeg

    try:
        img = simplejpeg.decode_jpeg(
            memoryview(data)[: info.end],
            colorspace=color,
            min_height=at_least[0],
            min_width=at_least[1],
            strict=True,
        )
    except ValueError as exc:
        message = plain(str(exc))
        kind = "unsupported" if "unsupported" in message.lower() else "corrupt"
        raise MediaError(f"{kind} JPEG: {message}") from None
    return np.asarray(img[:, :, 0] if color == "GRAY" else img, dtype=np.uint8)


def _decode_cv(data: bytes, info: ImageInfo, color: str) -> npt.NDArray[np.uint8]:
    """A PNG or WebP through OpenCV, as stored (its own EXIF handling off: ``orient`` does it)."""
    cv2 = _cv2()
    flag = cv2.IMREAD_GRAYSCALE if color == "GRAY" else cv2.IMREAD_COLOR
    img = cv2.imdecode(np.frombuffer(data, np.uint8, count=info.end), flag | cv2.IMREAD_IGNORE_ORIENTATION)
    fmt = info.format.upper()
    if img is None:
        raise MediaError(f"{fmt} not decodable: OpenCV's decoder refused it")
    if img.shape[0] != info.height or img.shape[1] != info.width:
        said, got = f"{info.width} x {info.height}", f"{img.shape[1]} x {img.shape[0]}"
        raise MediaError(f"corrupt {fmt}: header says {said}, decoded {got}")
    if color == "RGB":
        img = cv2.cvtColor(img, cv2.COLOR_BGR2RGB)
    return np.asarray(img, dtype=np.uint8)


@dataclass(frozen=True, kw_only=True)
class ImagePreprocess:
    """The image step's settings (see the module docstring)."""

    size: tuple[int, int] = (224, 224)
    """(height, width) of the tensor."""
    column: str = "image"
    output: str = "pixels"
    fit: str = "letterbox"
    color: str = "RGB"
    layout: str = "NCHW"
    dtype: str = "float32"
    scale: float = 1 / 255
    mean: tuple[float, ...] = (0.0, 0.0, 0.0)
    std: tuple[float, ...] = (1.0, 1.0, 1.0)
    pad_value: int = 0
    max_pixels: int = 40_000_000
    """Images with more pixels are refused from their header (decompression bombs)."""
    max_bytes: int = 32 << 20
    max_scans: int = MAX_SCANS
    """JPEGs of more scans are refused from their header (each scan is a pass over the image)."""
    exif_orientation: bool = True
    """Turn each image upright by its EXIF orientation (False: the pixels as stored)."""
    threads: int = 0
    """Decoding threads (0: one per core)."""
    input: str = "encoded"
    """``encoded``: image files; ``rgb24``: decoded pixels, as ``VideoDecode`` makes them (each
    row's width and height in ``width_column`` and ``height_column``)."""
    width_column: str = "frame_width"
    height_column: str = "frame_height"
    counters: MediaCounters = field(default_factory=lambda: MediaCounters("pixels"), compare=False)

    def __post_init__(self) -> None:
        if len(self.size) != 2 or min(self.size) < 1:
            raise ConfigError(f"size must be (height, width) >= 1, got {self.size}")
        if self.fit not in _FITS:
            raise ConfigError(f"fit must be one of {list(_FITS)}, got {self.fit!r}")
        if self.color not in ("RGB", "BGR", "GRAY"):
            raise ConfigError(f"color must be RGB, BGR or GRAY, got {self.color!r}")
        if self.layout not in ("NCHW", "NHWC"):
            raise ConfigError(f"layout must be NCHW or NHWC, got {self.layout!r}")
        if self.dtype not in ("float32", "uint8"):
            raise ConfigError(f"dtype must be float32 or uint8, got {self.dtype!r}")
        if len(self.mean) != self.channels or len(self.std) != self.channels or min(self.std) <= 0:
            raise ConfigError(f"mean and std need {self.channels} values (std > 0)")
        if self.input not in ("encoded", "rgb24"):
            raise ConfigError(f"input must be 'encoded' or 'rgb24', got {self.input!r}")
        if self.max_pixels < 1 or self.max_bytes < 1 or self.max_scans < 1:
            raise ConfigError(
                f"max_pixels, max_bytes and max_scans must be >= 1, got "
                f"{self.max_pixels}, {self.max_bytes}, {self.max_scans}"
            )

    @property
    def channels(self) -> int:
        return 1 if self.color == "GRAY" else 3

    @property
    def shape(self) -> tuple[int, int, int]:
        """One row's tensor shape (without the batch dimension)."""
        h, w = self.size
        c = self.channels
        return (c, h, w) if self.layout == "NCHW" else (h, w, c)

    def build(self, ctx: OperatorContext) -> Operator:
        return ImagePreprocessOp(self, ctx)


class ImageBuckets:
    """A batch function that names each row's shape bucket in ``output``, from its header alone:
    the size in ``sizes`` (name -> (height, width)) whose aspect ratio is nearest the image's
    (by log ratio), so a stream of mixed shapes can be routed (``stream.route(..., column=
    "bucket")``) to one ``ImagePreprocess`` and model step per bucket, each batching images of
    one shape with little padding, instead of letterboxing all into one shape. A row whose
    header does not parse goes to the first bucket, whose image step dead-letters it.

    >>> ImageBuckets({"wide": (320, 640), "tall": (640, 320)}).pick(b"not an image")
    'wide'
    """

    def __init__(
        self, sizes: dict[str, tuple[int, int]], *, column: str = "image", output: str = "bucket"
    ) -> None:
        if not sizes:
            raise ConfigError("ImageBuckets needs at least one size")
        self.names = list(sizes)
        self._log_aspects = np.log([w / h for h, w in sizes.values()])
        self.column, self.output = column, output

    def pick(self, data: bytes | str | None) -> str:
        try:
            width, height = image_info(_payload(data, 1 << 62)).size()
        except MediaError:
            return self.names[0]
        return self.names[int(np.abs(self._log_aspects - math.log(width / height)).argmin())]

    def __call__(self, batch: Batch) -> Batch:
        picked = [self.pick(d) for d in batch.column(self.column).to_pylist()]
        return batch.with_columns({self.output: pa.array(picked, pa.string())})


class ImagePreprocessOp:
    """The running image step."""

    def __init__(self, spec: ImagePreprocess, ctx: OperatorContext) -> None:
        self.spec, self._ctx = spec, ctx
        self._cv2 = _cv2()
        self._cv2.setNumThreads(1)  # the slices are the parallelism; OpenCV's own would oversubscribe
        self._threads = spec.threads or cores()
        c = spec.channels
        self._gain = np.asarray([spec.scale / s for s in spec.std], dtype=np.float32).reshape(1, 1, c)
        self._bias = np.asarray([m / s for m, s in zip(spec.mean, spec.std, strict=True)], dtype=np.float32)
        self._bias = self._bias.reshape(1, 1, c)

    def process(self, batch: Batch) -> Emit:
        spec = self.spec
        col = batch.column(spec.column)
        kinds = (pa.types.is_binary, pa.types.is_large_binary, pa.types.is_string, pa.types.is_null)
        if not any(kind(col.type) for kind in kinds):
            raise ConfigError(f"column {spec.column!r} is {col.type}, not binary")
        payloads: list[bytes | str | None] = col.to_pylist()
        rows = len(payloads)
        h, w = spec.size
        pixels = np.empty((rows, h, w, spec.channels), dtype=np.uint8)
        info = np.zeros((rows, 6), dtype=np.float64)  # height, width, scale x, scale y, offset x, y
        errors: list[str | None] = [None] * rows
        raw = spec.input == "rgb24"
        if raw:
            missing = [c for c in (spec.width_column, spec.height_column) if c not in batch.column_names]
            if missing:
                raise ConfigError(f"input='rgb24' needs the frame size columns {missing}")
            widths = batch.column(spec.width_column).to_pylist()
            heights = batch.column(spec.height_column).to_pylist()

        def work(start: int, end: int) -> tuple[int, int]:
            took = time.perf_counter_ns()
            nbytes = 0
            for i in range(start, end):
                try:
                    data = _payload(payloads[i], spec.max_bytes)
                    nbytes += len(data)
                    if raw:
                        img = self._raw(data, widths[i], heights[i])
                        info[i] = self._fit(img, pixels[i], img.shape[0], img.shape[1])
                        continue
                    head = image_info(data, max_scans=spec.max_scans)
                    width, height = head.size(spec.exif_orientation)
                    img = decode_image(
                        data,
                        info=head,
                        max_pixels=spec.max_pixels,
                        color=spec.color,
                        at_least=self._needed(height, width),
                        exif_orientation=spec.exif_orientation,
                    )
                    info[i] = self._fit(img, pixels[i], height, width)
                except MediaError as exc:
                    errors[i] = str(exc)
            return nbytes, time.perf_counter_ns() - took

        done = run_sliced(self._threads, rows, work)
        bad = [(i, e) for i, e in enumerate(errors) if e is not None]
        ok = np.flatnonzero(np.fromiter((e is None for e in errors), dtype=bool, count=rows))
        spec.counters.add(
            items=len(ok),
            refused=len(bad),
            nbytes=sum(b for b, _ in done),
            decode_ns=sum(t for _, t in done),
            units=len(ok) * h * w,
        )
        if bad:
            dead_letter_rows(self._ctx, batch, bad)
            batch, pixels, info = batch.take(ok), pixels[ok], info[ok]
        tensor = self._tensor(pixels)
        flat = pa.FixedSizeListArray.from_arrays(pa.array(tensor.reshape(-1)), int(np.prod(spec.shape)))
        names = ("height", "width", "scale_x", "scale_y", "offset_x", "offset_y")
        cols: dict[str, Any] = {spec.output: flat}
        for j, name in enumerate(names):
            cols[f"image_{name}"] = info[:, j].astype(np.int64) if j < 2 else info[:, j]
        return [(DEFAULT_PORT, batch.with_columns(cols))]

    def _raw(self, data: bytes, width: int | None, height: int | None) -> npt.NDArray[np.uint8]:
        """A row of RGB24 pixels, ``height`` x ``width``, in the step's colour order."""
        if not width or not height or width < 1 or height < 1:
            raise MediaError(f"no frame size (width {width}, height {height})")
        if width * height > self.spec.max_pixels:
            raise MediaError(f"image too large: {width} x {height} pixels (limit {self.spec.max_pixels})")
        if len(data) != width * height * 3:
            raise MediaError(f"raw frame of {len(data)} bytes is not {width} x {height} x 3 (RGB24)")
        img = np.frombuffer(data, np.uint8).reshape(height, width, 3)
        if self.spec.color == "BGR":
            return np.ascontiguousarray(img[:, :, ::-1])
        if self.spec.color == "GRAY":
            return np.asarray(self._cv2.cvtColor(img, self._cv2.COLOR_RGB2GRAY), dtype=np.uint8)
        return img

    def _needed(self, ih: int, iw: int) -> tuple[int, int]:
        """The smallest (height, width) an image of ``ih`` x ``iw`` may decode to and still
        give the tensor every pixel it needs."""
        h, w = self.spec.size
        if self.spec.fit == "stretch":
            return h, w
        s = min(h / ih, w / iw) if self.spec.fit == "letterbox" else max(h / ih, w / iw)
        return math.ceil(ih * s), math.ceil(iw * s)

    def _fit(
        self, img: npt.NDArray[np.uint8], out: npt.NDArray[np.uint8], ih: int, iw: int
    ) -> tuple[float, ...]:
        """Resize ``img`` (an ``ih`` x ``iw`` image, maybe decoded smaller) into ``out`` as
        ``fit`` says; (height, width, scales, offsets) from the original image to the tensor."""
        cv2, spec = self._cv2, self.spec
        dh, dw = img.shape[:2]
        fy, fx = dh / ih, dw / iw  # decoded / original
        h, w = spec.size
        if img.ndim == 2:
            img = img[:, :, None]
        interp = cv2.INTER_AREA if dh * dw > h * w else cv2.INTER_LINEAR
        if spec.fit == "stretch":
            out[:] = cv2.resize(img, (w, h), interpolation=interp).reshape(out.shape)
            return ih, iw, w / iw, h / ih, 0.0, 0.0
        if spec.fit == "letterbox":
            s = min(h / dh, w / dw)
            nh, nw = max(1, min(h, round(dh * s))), max(1, min(w, round(dw * s)))
            y0, x0 = (h - nh) // 2, (w - nw) // 2
            out.fill(spec.pad_value)
            out[y0 : y0 + nh, x0 : x0 + nw] = cv2.resize(img, (nw, nh), interpolation=interp).reshape(
                nh, nw, -1
            )
            return ih, iw, nw / iw, nh / ih, float(x0), float(y0)
        s = max(h / dh, w / dw)  # crop: the centre window of the source that fills the tensor
        ch, cw = min(dh, max(1, round(h / s))), min(dw, max(1, round(w / s)))
        y0, x0 = (dh - ch) // 2, (dw - cw) // 2
        window = np.ascontiguousarray(img[y0 : y0 + ch, x0 : x0 + cw])
        out[:] = cv2.resize(window, (w, h), interpolation=interp).reshape(out.shape)
        sx, sy = w / cw, h / ch  # decoded -> tensor
        return ih, iw, sx * fx, sy * fy, -x0 * sx, -y0 * sy

    def _tensor(self, pixels: npt.NDArray[np.uint8]) -> npt.NDArray[Any]:
        spec = self.spec
        if spec.dtype == "float32":
            out = np.empty(pixels.shape, dtype=np.float32)

            def norm(start: int, end: int) -> None:  # numpy's loops release the GIL: per slice
                np.multiply(pixels[start:end], self._gain, out=out[start:end])
                out[start:end] -= self._bias

            run_sliced(self._threads, len(pixels), norm, min_rows=4)
            tensor: npt.NDArray[Any] = out
        else:
            tensor = pixels
        if spec.layout == "NCHW":
            tensor = np.ascontiguousarray(tensor.transpose(0, 3, 1, 2))
        return tensor

    def flush(self) -> Emit:
        return []
