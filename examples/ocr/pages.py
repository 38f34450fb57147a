"""Sample pages for the OCR example: lines of known words drawn on noisy paper, as JPEG, PNG and
WebP of different sizes, each with the text it holds (what a reader should find).

    python examples/ocr/pages.py DIR --pages 32     # DIR/page-0000.jpg ... and DIR/truth.jsonl
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import cv2
import numpy as np

WORDS = (
    "stream", "invoice", "total", "order", "paid", "amount", "window", "model", "batch", "event",
    "latency", "queue", "score", "fraud", "risk", "user", "card", "shop", "city", "price", "item",
    "delivery", "account", "balance", "report", "north", "south", "station", "summer", "winter",
    "coffee", "river", "garden",
)  # fmt: skip
FONTS = (cv2.FONT_HERSHEY_SIMPLEX, cv2.FONT_HERSHEY_DUPLEX, cv2.FONT_HERSHEY_TRIPLEX)
EXTENSIONS = (".jpg", ".png", ".webp")


def page(seed: int) -> tuple[str, bytes, list[str]]:
    """(extension, encoded image, lines of text) of page ``seed``."""
    rng = np.random.default_rng(seed)
    h, w = int(rng.integers(240, 720)), int(rng.integers(480, 1280))
    img = np.clip(rng.normal(236, 8, (h, w, 3)), 0, 255).astype(np.uint8)
    scale = w / 640
    lines, y = [], int(50 * scale)
    while y < h - 20 * scale and len(lines) < 4:
        words = [str(rng.choice(WORDS)) for _ in range(int(rng.integers(1, 4)))]
        if rng.random() < 0.5:
            words.append(str(int(rng.integers(10, 9999))))
        text = " ".join(words)
        ink = tuple(int(v) for v in rng.integers(0, 60, 3))
        cv2.putText(
            img,
            text,
            (int(20 * scale), y),
            FONTS[seed % 3],
            1.1 * scale,
            ink,
            max(1, round(2 * scale)),
            cv2.LINE_AA,
        )
        lines.append(text)
        y += int(rng.integers(60, 90) * scale)
    ext = EXTENSIONS[seed % len(EXTENSIONS)]
    ok, buf = cv2.imencode(ext, img, [cv2.IMWRITE_JPEG_QUALITY, 90] if ext == ".jpg" else [])
    assert ok
    return ext, buf.tobytes(), lines


def rows(pages: int) -> list[dict[str, Any]]:
    """The pages as input rows ``{"id", "image"}`` (the bytes), in order."""
    return [{"id": f"page-{i:04d}", "image": page(i)[1]} for i in range(pages)]


def write(directory: Path, pages: int) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    with (directory / "truth.jsonl").open("w") as truth:
        for i in range(pages):
            ext, data, lines = page(i)
            (directory / f"page-{i:04d}{ext}").write_bytes(data)
            truth.write(json.dumps({"id": f"page-{i:04d}", "lines": lines}) + "\n")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("directory", type=Path)
    parser.add_argument("--pages", type=int, default=32)
    args = parser.parse_args()
    write(args.directory, args.pages)
