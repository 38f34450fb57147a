"""Text from a stream of images: pages in, text regions with their text and confidence out.

    rows {"id", "image"}  (JPEG, PNG or WebP bytes; base64 in JSON)
      -> prepare (ImagePreprocess: decode on every core, letterbox to 320 x 640, BGR, normalised;
         hostile images -> dead letters with the reason)
      -> read (TextReader: PP-OCRv4 detection on the whole batch, recognition of every region,
         dynamic batching)
      -> {"id", "texts", "scores", "boxes", "regions"}  (boxes: 8 numbers per region, x, y of its
         corners in the original image's pixels)

Run it: ``aisp run examples/ocr/pipeline.py --output out.jsonl`` (64 generated pages, see
``pages.py``), ``--param directory=DIR`` for the images in a directory (``python
examples/ocr/pages.py DIR`` writes some, with the text they hold), or serve it: ``aisp serve
examples/ocr/pipeline.py`` and POST ``{"id": "p1", "image": "<base64>"}`` events.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import msgspec
import numpy as np
import pyarrow as pa

from aisp import BatcherConfig, FilesSource, NullSink, Pipeline, TestingSource
from aisp.batch import Batch
from aisp.infer.runtimes.ocr import TextReader, det_preprocess
from aisp.transform.media.images import ImagePreprocess

HERE = Path(__file__).resolve().parent
OUTPUT_COLUMNS = ["id", "texts", "scores", "boxes", "regions"]


class Row(msgspec.Struct):
    """One input row: an image's id and its encoded bytes (base64 in JSON)."""

    id: str
    image: bytes


def _pages() -> object:
    spec = importlib.util.spec_from_file_location("aisp_example_ocr_pages", HERE / "pages.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def to_original(batch: Batch) -> Batch:
    """Each region's corners from the tensor's pixels back to the original image's."""
    boxes = batch.column("boxes")
    flat = boxes.flatten().to_numpy(zero_copy_only=False).astype(np.float64).reshape(-1, 2)
    lengths = np.diff(boxes.offsets.to_numpy()) // 2
    row = np.repeat(np.arange(batch.num_rows), lengths)
    scale = np.stack([batch.numpy("image_scale_x"), batch.numpy("image_scale_y")], axis=1)[row]
    offset = np.stack([batch.numpy("image_offset_x"), batch.numpy("image_offset_y")], axis=1)[row]
    original = np.round((flat - offset) / scale, 1).reshape(-1)
    return batch.with_columns({"boxes": pa.ListArray.from_arrays(boxes.offsets, pa.array(original))})


def build(
    pages: int | str = 64, directory: str = "", height: int | str = 320, width: int | str = 640
) -> Pipeline:
    """The OCR example: ``pages`` generated pages, or the images in ``directory`` (``--param``)."""
    size = (int(height), int(width))
    p = Pipeline("ocr", output_columns=OUTPUT_COLUMNS)
    if directory:
        source = p.source(
            "pages", FilesSource(directory, pattern="*.*", column="image", path_column="id", batch_rows=16)
        )
    else:
        rows = _pages().rows(int(pages))  # type: ignore[attr-defined]
        source = p.source("pages", TestingSource(rows, batch_rows=16), schema=Row)
    prepared = source.apply("prepare", ImagePreprocess(size=size, **det_preprocess()), latency_budget_ms=50.0)
    reader = TextReader(size)
    read = prepared.infer(
        "read",
        reader,
        inputs={"image": "pixels"},
        outputs={n: n for n in reader.output_names},
        batcher=BatcherConfig(max_batch_size=8, max_queue_delay_ms=10.0),
        latency_budget_ms=500.0,
    )
    read.map_batch("boxes", to_original).sink("out", NullSink())
    return p
