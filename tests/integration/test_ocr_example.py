"""The OCR example (`examples/ocr/`): generated pages read back with their words, boxes on the
original image, hostile images as dead letters with reasons next to valid ones, and the pipeline
served over HTTP with base64 images in JSON."""

from __future__ import annotations

import base64
import difflib
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx

from aisp import CollectSink
from benchmarks.workload import load_example
from tests.support.serving import aisp_serve, wait_http
from tests.unit.transform.media.test_images import hostile

ROOT = Path(__file__).resolve().parents[2]
PIPELINE = ROOT / "examples" / "ocr" / "pipeline.py"
PAGES = load_example("ocr/pages.py", "aisp_example_ocr_pages")


def similarity(found: list[str], lines: list[str]) -> float:
    """How alike the text read and the text drawn are, spaces and case aside (0..1)."""
    a = "".join(found).replace(" ", "").lower()
    b = "".join(lines).replace(" ", "").lower()
    return difflib.SequenceMatcher(None, a, b).ratio()


def test_pages_are_read_with_their_words_and_boxes_on_the_original(tmp_path: Path) -> None:
    PAGES.write(tmp_path, 9)
    p = load_example("ocr/pipeline.py", "aisp_example_ocr_pipeline").build(directory=str(tmp_path))
    out = CollectSink(columns=["id", "texts", "scores", "boxes", "regions"])
    p.bind(sink=out)
    summary = p.run()
    assert summary.events_out == 9 and len(out.rows) == 9
    truth = {
        json.loads(x)["id"]: json.loads(x)["lines"]
        for x in (tmp_path / "truth.jsonl").read_text().splitlines()
    }
    scores = []
    for row in out.rows:
        lines = truth[Path(row["id"]).stem]
        scores.append(similarity(row["texts"], lines))
        assert row["regions"] == len(row["texts"]) == len(row["scores"]) == len(row["boxes"]) // 8
        assert all(0 <= s <= 1 for s in row["scores"])
        h, w = _size(Path(row["id"]))
        xs, ys = row["boxes"][0::2], row["boxes"][1::2]
        assert min(xs) >= -1 and max(xs) <= w + 1 and min(ys) >= -1 and max(ys) <= h + 1
    assert sum(scores) / len(scores) >= 0.85, scores


def _size(path: Path) -> tuple[int, int]:
    import cv2

    img = cv2.imread(str(path))
    return img.shape[0], img.shape[1]


def test_hostile_images_are_dead_letters_and_valid_ones_are_read(tmp_path: Path) -> None:
    rows: list[dict[str, Any]] = [{"id": "good-0", "image": PAGES.page(0)[1]}]
    cases = {name: data for name, (data, _) in hostile().items() if data is not None}
    rows += [{"id": name, "image": data} for name, data in cases.items()]
    rows.append({"id": "good-1", "image": PAGES.page(1)[1]})
    lines = [json.dumps({"id": r["id"], "image": base64.b64encode(r["image"]).decode()}) for r in rows]
    lines.append('{"id": "no image"}')
    (tmp_path / "in.jsonl").write_text("\n".join(lines) + "\n")
    cmd = [sys.executable, "-m", "aisp.cli", "run", str(PIPELINE), "--input", str(tmp_path / "in.jsonl"),
           "--output", str(tmp_path / "out.jsonl"), "--dead-letter", str(tmp_path / "dl.jsonl")]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr
    out = [json.loads(x) for x in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert [r["id"] for r in out] == ["good-0", "good-1"]
    dead = [json.loads(x) for x in (tmp_path / "dl.jsonl").read_text().splitlines()]
    assert len(dead) == len(cases) + 1
    assert all(d["reason"] for d in dead)
    by_step = {d.get("step") for d in dead}
    assert by_step == {"prepare", "pages"}, by_step


def test_served_pipeline_reads_base64_images_over_http() -> None:
    with aisp_serve(PIPELINE, http=True, grpc=False, extra_args=("--param", "pages=0")) as (addresses, _):
        wait_http(addresses["http"], timeout_s=120)
        _, data, lines = PAGES.page(3)
        events = [
            {"id": "p3", "image": base64.b64encode(data).decode()},
            {"id": "photo", "image": base64.b64encode(photo_of(data)).decode()},
            {"id": "bad", "image": "AAAA"},
        ]
        assert len(events[1]["image"]) > 1 << 20  # a line longer than a pipeline without bytes takes
        body = "\n".join(json.dumps(e) for e in events)
        r = httpx.post(f"http://{addresses['http']}/v1/pipelines/ocr/events", content=body, timeout=120)
        assert r.status_code == 200, r.text
        answers = [json.loads(x) for x in r.content.splitlines()]
        for name in ("p3", "photo"):
            read = next(a for a in answers if a.get("id") == name)
            assert similarity(read["texts"], lines) >= 0.8, (name, read["texts"])
        assert any("image" in json.dumps(a) and "not an image" in json.dumps(a) for a in answers), answers


def photo_of(page: bytes) -> bytes:
    """The page as a phone would send it: three times the pixels, sensor noise, a JPEG of more
    than 1.2 MB."""
    import cv2
    import numpy as np

    img = cv2.imdecode(np.frombuffer(page, np.uint8), cv2.IMREAD_COLOR)
    big = cv2.resize(img, None, fx=3, fy=3, interpolation=cv2.INTER_CUBIC).astype(np.int16)
    noisy = np.clip(big + np.random.default_rng(0).integers(-12, 13, big.shape), 0, 255).astype(np.uint8)
    data: bytes = cv2.imencode(".jpg", noisy, [cv2.IMWRITE_JPEG_QUALITY, 95])[1].tobytes()
    assert len(data) > 1_200_000, len(data)
    return data


def line_match(found: list[str], lines: list[str]) -> float:
    """The mean over the lines drawn of how alike the best text read is (0..1), in any order."""
    norm = [t.replace(" ", "").lower() for t in found]
    best = [
        max(
            (difflib.SequenceMatcher(None, t, line.replace(" ", "").lower()).ratio() for t in norm),
            default=0.0,
        )
        for line in lines
    ]
    return sum(best) / len(best)


def test_upside_down_pages_are_turned_by_the_direction_classifier() -> None:
    import cv2
    import numpy as np

    from aisp import BatcherConfig, Pipeline, TestingSource
    from aisp.infer.runtimes.ocr import TextReader, det_preprocess
    from aisp.transform.media.images import ImagePreprocess

    pages = [PAGES.page(i) for i in range(4)]
    rows = []
    for i, (_, data, _) in enumerate(pages):
        img = cv2.rotate(cv2.imdecode(np.frombuffer(data, np.uint8), cv2.IMREAD_COLOR), cv2.ROTATE_180)
        rows.append({"id": str(i), "image": cv2.imencode(".png", img)[1].tobytes()})

    def read(upright: bool) -> list[float]:
        p, out = Pipeline("flipped"), CollectSink(columns=["id", "texts"])
        reader = TextReader((320, 640), upright=upright)
        p.source("src", TestingSource(rows)).apply(
            "prep", ImagePreprocess(size=(320, 640), **det_preprocess())
        ).infer(
            "read",
            reader,
            inputs={"image": "pixels"},
            outputs={n: n for n in reader.output_names},
            batcher=BatcherConfig(max_batch_size=8, max_queue_delay_ms=10.0),  # warmed up to 8 only
        ).sink("out", out)
        p.run()
        return [line_match(r["texts"], pages[int(r["id"])][2]) for r in out.rows]

    turned, as_is = read(True), read(False)
    assert len(turned) == len(as_is) == 4
    assert sum(turned) / 4 >= 0.85, turned
    assert sum(as_is) / 4 < sum(turned) / 4 - 0.3, (as_is, turned)
