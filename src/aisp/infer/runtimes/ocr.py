"""Text in images as one model of the ``infer`` step: image tensors in, text regions and their text out.

``TextReader`` wraps PP-OCR's three ONNX models (from the ``rapidocr-onnxruntime`` package,
installed ``--no-deps`` by ``make``: ``packaged_ppocr()`` finds them without importing it):

1. **detection** (DBNet) runs on the whole batch at once: the infer step's dynamic batching
   gives it many images per call, all of one shape, which ``ImagePreprocess`` made (letterboxed
   to ``size``, a multiple of 32, BGR, ImageNet mean and deviation: ``det_preprocess()``);
2. each image's probability map becomes boxes (threshold, contours, each contour's rotated
   rectangle, kept if its mean probability is at least ``box_threshold``, then grown by
   ``unclip`` as DBNet shrank it in training), in the tensor's pixels;
3. **recognition** (SVTR, CTC) runs on every region of the batch together: each region is cut
   out of the image (its rotated rectangle straightened) and turned the right way up where the
   direction classifier (PP-OCR's text-line orientation model, 0 or 180 degrees, on every
   region of the batch at once) is at least ``upright_threshold`` sure it is upside down, then
   scaled to 48 pixels high; the regions are sorted by width and run in chunks, each padded
   to its widest, so a long line does not make every short word pay for its padding; greedy
   CTC decoding with the model's own alphabet (its ``character`` metadata) gives the text and
   the mean probability of its characters.

Outputs per row: ``texts`` (list of strings), ``scores`` (list of floats), ``boxes`` (list of
8 floats per region, four corners x, y in the tensor's pixels, clockwise from top left: map them
to the original image with the ``image_scale_*`` and ``image_offset_*`` columns the image step
adds) and ``regions`` (how many).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from aisp.errors import ConfigError, ModelError
from aisp.infer.runtimes.base import Arrays, OnnxRuntime, TensorSpec

__all__ = ["TextReader", "det_preprocess", "packaged_ppocr"]

_MEAN = (0.485, 0.456, 0.406)
_STD = (0.229, 0.224, 0.225)
_REC_HEIGHT = 48


def packaged_ppocr() -> tuple[Path, Path, Path]:
    """(detection, recognition, direction classifier) ONNX files of PP-OCR (v4; the classifier
    is v2.0's) from the ``rapidocr-onnxruntime`` package."""
    spec = importlib.util.find_spec("rapidocr_onnxruntime")
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError(
            "package 'rapidocr_onnxruntime' is not installed: pip install --no-deps rapidocr-onnxruntime"
        )
    models = Path(next(iter(spec.submodule_search_locations))) / "models"
    names = (
        "ch_PP-OCRv4_det_infer.onnx",
        "ch_PP-OCRv4_rec_infer.onnx",
        "ch_ppocr_mobile_v2.0_cls_infer.onnx",
    )
    det, rec, cls = (models / name for name in names)
    for path in (det, rec, cls):
        if not path.is_file():
            raise ConfigError(f"{path} is missing from its package")
    return det, rec, cls


def det_preprocess() -> dict[str, Any]:
    """``ImagePreprocess`` settings for the detector: BGR, ImageNet mean and deviation, NCHW."""
    return {"color": "BGR", "mean": _MEAN, "std": _STD, "layout": "NCHW", "fit": "letterbox"}


class TextReader:
    """PP-OCR detection, direction and recognition as one model (see the module docstring); its one input
    ``image`` is ``[rows, 3 * height * width]`` as ``ImagePreprocess(**det_preprocess())`` makes it."""

    def __init__(
        self,
        size: tuple[int, int],
        *,
        det: str | Path | None = None,
        rec: str | Path | None = None,
        cls: str | Path | None = None,
        upright: bool = True,
        upright_threshold: float = 0.9,
        name: str = "ppocr",
        threshold: float = 0.3,
        box_threshold: float = 0.5,
        unclip: float = 1.6,
        min_side: float = 3.0,
        max_regions: int = 100,
        rec_chunk: int = 16,
        max_rec_width: int = 960,
        threads: int = 1,
    ) -> None:
        if size[0] % 32 or size[1] % 32:
            raise ConfigError(f"the detector needs a size that is a multiple of 32, got {size}")
        if det is None or rec is None or (upright and cls is None):
            packaged = packaged_ppocr()
            det, rec, cls = det or packaged[0], rec or packaged[1], cls or packaged[2]
        self._det = OnnxRuntime(det, name=f"{name}-det", intra_op_threads=threads)
        self._rec = OnnxRuntime(rec, name=f"{name}-rec", intra_op_threads=threads)
        self._cls = (
            OnnxRuntime(cls, name=f"{name}-cls", intra_op_threads=threads) if upright and cls else None
        )
        self._upright_threshold = upright_threshold
        import onnxruntime as ort

        meta = ort.InferenceSession(str(rec), providers=["CPUExecutionProvider"]).get_modelmeta()
        chars = meta.custom_metadata_map.get("character")
        if not chars:
            raise ConfigError(f"{rec} has no 'character' metadata: not a PP-OCR recognition model?")
        self._alphabet = np.array(["", *chars.splitlines(), " "], dtype=object)
        self.size, self.name = size, name
        self._threshold, self._box_threshold, self._unclip = threshold, box_threshold, unclip
        self._min_side, self._max_regions = min_side, max_regions
        self._rec_chunk, self._max_rec_width = rec_chunk, max_rec_width
        self.input_names = ("image",)
        self.output_names = ("texts", "scores", "boxes", "regions")
        h, w = size
        self.input_specs: Mapping[str, TensorSpec] = {
            "image": TensorSpec(np.dtype(np.float32), (None, 3 * h * w))
        }
        import cv2

        self._cv2 = cv2

    @property
    def version(self) -> str:
        return "PP-OCRv4"

    @property
    def provider(self) -> str:
        return self._det.provider

    def run(self, inputs: Mapping[str, npt.NDArray[Any]]) -> Arrays:
        h, w = self.size
        images = np.ascontiguousarray(inputs["image"], dtype=np.float32).reshape(-1, 3, h, w)
        rows = images.shape[0]
        probs = next(iter(self._det.run({self._det.input_names[0]: images}).values()))
        if probs.shape[0] != rows or probs.shape[-2:] != (h, w):
            raise ModelError(f"detector output {probs.shape} does not match input {images.shape}")
        boxes = [self._boxes(probs[i].reshape(h, w)) for i in range(rows)]
        crops, owner = [], []
        for i, found in enumerate(boxes):
            if found:
                bgr = self._pixels(images[i])
                for box in found:
                    crops.append(self._crop(bgr, box))
                    owner.append(i)
        texts, scores = self._read(self._upright(crops))
        out_texts = np.empty(rows, dtype=object)
        out_scores = np.empty(rows, dtype=object)
        out_boxes = np.empty(rows, dtype=object)
        for i in range(rows):
            out_texts[i], out_scores[i], out_boxes[i] = [], [], []
        for j, i in enumerate(owner):
            out_texts[i].append(texts[j])
            out_scores[i].append(scores[j])
            out_boxes[i].extend(float(v) for v in boxes[i][len(out_texts[i]) - 1].reshape(-1))
        regions = np.fromiter((len(t) for t in out_texts), dtype=np.int64, count=rows)
        return {"texts": out_texts, "scores": out_scores, "boxes": out_boxes, "regions": regions}

    def _pixels(self, tensor: npt.NDArray[np.float32]) -> npt.NDArray[np.uint8]:
        """The detector's input back to BGR ``uint8`` pixels (for cutting regions out)."""
        mean = np.asarray(_MEAN, dtype=np.float32)[:, None, None]
        std = np.asarray(_STD, dtype=np.float32)[:, None, None]
        pixels = (tensor * std + mean) * 255.0
        out: npt.NDArray[np.uint8] = np.clip(pixels, 0, 255).astype(np.uint8).transpose(1, 2, 0).copy()
        return out

    def _boxes(self, prob: npt.NDArray[np.float32]) -> list[npt.NDArray[np.float32]]:
        """DBNet's post-processing: the rotated rectangles of the text regions in ``prob``."""
        cv2 = self._cv2
        bitmap = (prob > self._threshold).astype(np.uint8)
        contours, _ = cv2.findContours(bitmap, cv2.RETR_LIST, cv2.CHAIN_APPROX_SIMPLE)
        h, w = prob.shape
        out = []
        for contour in contours[: self._max_regions * 4]:
            rect = cv2.minAreaRect(contour)
            if min(rect[1]) < self._min_side:
                continue
            x, y, bw, bh = cv2.boundingRect(contour)
            mask = np.zeros((bh, bw), dtype=np.uint8)
            cv2.fillPoly(mask, [contour.reshape(-1, 2) - (x, y)], 1)
            if cv2.mean(prob[y : y + bh, x : x + bw], mask)[0] < self._box_threshold:
                continue
            (cx, cy), (rw, rh), angle = rect
            grow = rw * rh * self._unclip / max(2 * (rw + rh), 1e-6)  # DBNet's unclip distance
            rw, rh = rw + 2 * grow, rh + 2 * grow
            if min(rw, rh) < self._min_side + 2:
                continue
            corners = cv2.boxPoints(((cx, cy), (rw, rh), angle))
            corners[:, 0] = np.clip(corners[:, 0], 0, w - 1)
            corners[:, 1] = np.clip(corners[:, 1], 0, h - 1)
            out.append(_clockwise(corners))
            if len(out) == self._max_regions:
                break
        out.sort(key=lambda b: (round(float(b[0, 1]) / 10), float(b[0, 0])))  # reading order
        return out

    def _crop(self, image: npt.NDArray[np.uint8], box: npt.NDArray[np.float32]) -> npt.NDArray[np.uint8]:
        """The region ``box`` straightened (a perspective warp), upright."""
        cv2 = self._cv2
        width = int(max(np.linalg.norm(box[0] - box[1]), np.linalg.norm(box[2] - box[3])))
        height = int(max(np.linalg.norm(box[0] - box[3]), np.linalg.norm(box[1] - box[2])))
        width, height = max(width, 1), max(height, 1)
        target = np.array([[0, 0], [width, 0], [width, height], [0, height]], dtype=np.float32)
        m = cv2.getPerspectiveTransform(box.astype(np.float32), target)
        crop = cv2.warpPerspective(
            image, m, (width, height), borderMode=cv2.BORDER_REPLICATE, flags=cv2.INTER_CUBIC
        )
        if height / width >= 1.5:
            crop = np.rot90(crop)
        return np.ascontiguousarray(crop)

    @staticmethod
    def _width(crop: npt.NDArray[np.uint8], most: int) -> int:
        """``crop``'s width at 48 pixels high, keeping its aspect, at most ``most``."""
        return min(most, max(1, round(_REC_HEIGHT * int(crop.shape[1]) / int(crop.shape[0]))))

    def _strip(self, crop: npt.NDArray[np.uint8], width: int) -> npt.NDArray[np.float32]:
        """``crop`` scaled to ``width`` x 48 pixels as the line models take it: CHW, in -1..1."""
        resized = self._cv2.resize(crop, (width, _REC_HEIGHT)).astype(np.float32)
        out: npt.NDArray[np.float32] = (resized.transpose(2, 0, 1) / 255.0 - 0.5) / 0.5
        return out

    def _upright(self, crops: list[npt.NDArray[np.uint8]]) -> list[npt.NDArray[np.uint8]]:
        """The crops, those the direction classifier finds upside down turned 180 degrees; it
        reads each as PP-OCR does, 48 x 192 pixels (keeping the aspect, padded), in chunks."""
        if self._cls is None or not crops:
            return crops
        out = list(crops)
        for start in range(0, len(crops), self._rec_chunk):
            chunk = range(start, min(start + self._rec_chunk, len(crops)))
            batch = np.zeros((len(chunk), 3, _REC_HEIGHT, 192), dtype=np.float32)
            for k, i in enumerate(chunk):
                width = self._width(crops[i], 192)
                batch[k, :, :, :width] = self._strip(crops[i], width)
            probs = next(iter(self._cls.run({self._cls.input_names[0]: batch}).values()))
            for k, i in enumerate(chunk):
                if probs[k].argmax() == 1 and probs[k, 1] >= self._upright_threshold:
                    out[i] = np.ascontiguousarray(crops[i][::-1, ::-1])
        return out

    def _read(self, crops: list[npt.NDArray[np.uint8]]) -> tuple[list[str], list[float]]:
        """Recognition of every crop: sorted by width, in chunks padded to their widest."""
        n = len(crops)
        texts, scores = [""] * n, [0.0] * n
        widths = [self._width(c, self._max_rec_width) for c in crops]
        order = sorted(range(n), key=widths.__getitem__)
        for start in range(0, n, self._rec_chunk):
            chunk = order[start : start + self._rec_chunk]
            width = max(320, max(widths[i] for i in chunk))
            batch = np.zeros((len(chunk), 3, _REC_HEIGHT, width), dtype=np.float32)
            for k, i in enumerate(chunk):
                batch[k, :, :, : widths[i]] = self._strip(crops[i], widths[i])
            probs = next(iter(self._rec.run({self._rec.input_names[0]: batch}).values()))
            for k, i in enumerate(chunk):
                texts[i], scores[i] = self._ctc(probs[k])
        return texts, scores

    def _ctc(self, probs: npt.NDArray[np.float32]) -> tuple[str, float]:
        """Greedy CTC: the best class per step, repeats merged, blanks dropped."""
        best = probs.argmax(axis=1)
        keep = best != 0
        keep[1:] &= best[1:] != best[:-1]
        if not keep.any():
            return "", 0.0
        chars = best[keep]
        if chars.max() >= len(self._alphabet):
            raise ModelError(
                f"recognition output has {probs.shape[1]} classes, the alphabet {len(self._alphabet)}"
            )
        return "".join(self._alphabet[chars]), float(probs.max(axis=1)[keep].mean())

    def warmup(self, batch_sizes: Sequence[int]) -> None:
        h, w = self.size
        for rows in batch_sizes:
            self.run({"image": np.zeros((rows, 3 * h * w), dtype=np.float32)})
        self._read(self._upright([np.zeros((_REC_HEIGHT, 160, 3), dtype=np.uint8)]))

    def __repr__(self) -> str:
        return f"TextReader({self.size}, det={self._det!r}, rec={self._rec!r})"


def _clockwise(corners: npt.NDArray[np.float32]) -> npt.NDArray[np.float32]:
    """Four corners as top-left, top-right, bottom-right, bottom-left."""
    by_x = corners[np.argsort(corners[:, 0], kind="stable")]
    left, right = by_x[:2], by_x[2:]
    tl, bl = left[np.argsort(left[:, 1])]
    tr, br = right[np.argsort(right[:, 1])]
    return np.array([tl, tr, br, bl], dtype=np.float32)
