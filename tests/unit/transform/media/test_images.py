"""The image step: decode, fit, normalise, and hostile bytes as dead letters with reasons."""

from __future__ import annotations

import base64
import os
import subprocess
import sys
from typing import Any

import cv2
import numpy as np
import pyarrow as pa
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from aisp.batch import Batch
from aisp.errors import ConfigError
from aisp.transform.media.images import (
    ImagePreprocess,
    ImagePreprocessOp,
    MediaError,
    decode_image,
    image_header,
)
from aisp.transform.operators import OperatorContext


def encode(img: np.ndarray, ext: str = ".png", **params: int) -> bytes:
    flags = [v for kv in params.items() for v in (getattr(cv2, kv[0]), kv[1])]
    ok, buf = cv2.imencode(ext, img, flags)
    assert ok
    return buf.tobytes()


def picture(h: int, w: int, seed: int = 0) -> np.ndarray:
    """A BGR image with structure (gradients and noise), so codecs have something to keep."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:h, 0:w]
    img = np.stack([x * 255 // max(1, w - 1), y * 255 // max(1, h - 1), (x + y) % 256], axis=2)
    return np.clip(img + rng.integers(0, 20, img.shape), 0, 255).astype(np.uint8)


class Harness:
    def __init__(self, **settings: Any) -> None:
        self.dead: list[tuple[list[int], str]] = []
        ctx = OperatorContext(
            "prep", lambda b, step, reason, fields=None: self.dead.append((b.ids.tolist(), reason))
        )
        self.spec = ImagePreprocess(**settings)
        self.op = self.spec.build(ctx)
        assert isinstance(self.op, ImagePreprocessOp)

    def run(self, payloads: list[Any], kind: pa.DataType | None = None) -> Batch:
        batch = Batch.from_columns(
            {"image": pa.array(payloads, kind or pa.binary())}, ids=np.arange(len(payloads))
        )
        [(_, out)] = self.op.process(batch)
        return out

    def reasons(self) -> dict[int, str]:
        return {i: reason for ids, reason in self.dead for i in ids}


def test_header_reads_size_and_format_of_each_codec() -> None:
    img = picture(30, 50)
    assert image_header(encode(img, ".jpg")) == ("jpeg", 50, 30)
    assert image_header(encode(img, ".png")) == ("png", 50, 30)
    assert image_header(encode(img, ".webp")) == ("webp", 50, 30)  # lossy VP8
    assert image_header(encode(img, ".webp", IMWRITE_WEBP_QUALITY=101)) == ("webp", 50, 30)  # VP8L


def test_decode_gives_rgb_pixels() -> None:
    img = picture(8, 12)
    out = decode_image(encode(img, ".png"))
    assert out.shape == (8, 12, 3)
    np.testing.assert_array_equal(out, img[:, :, ::-1])


@pytest.mark.parametrize("fit", ["letterbox", "crop", "stretch"])
@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
def test_every_row_becomes_a_tensor_of_the_asked_shape(fit: str, layout: str) -> None:
    h = Harness(size=(32, 48), fit=fit, layout=layout, mean=(0.5, 0.5, 0.5), std=(0.25, 0.25, 0.25))
    imgs = [picture(60, 20, 1), picture(20, 90, 2), picture(32, 48, 3)]
    out = h.run([encode(imgs[0], ".png"), encode(imgs[1], ".jpg"), encode(imgs[2], ".webp")])
    assert out.num_rows == 3 and not h.dead
    tensor = out.numpy("pixels").reshape(3, *h.spec.shape)
    assert tensor.dtype == np.float32
    assert h.spec.shape == ((3, 32, 48) if layout == "NCHW" else (32, 48, 3))
    assert out.numpy("image_height").tolist() == [60, 20, 32]
    assert out.numpy("image_width").tolist() == [20, 90, 48]
    assert np.all(tensor >= -2.0 - 1e-6) and np.all(tensor <= 2.0 + 1e-6)  # (x/255 - .5) / .25
    if fit == "letterbox":  # the tall image is padded left and right with zeros -> (0 - .5)/.25
        hwc = tensor[0].transpose(1, 2, 0) if layout == "NCHW" else tensor[0]
        x0 = int(out.numpy("image_offset_x")[0])
        assert x0 > 0 and np.all(hwc[:, : x0 - 1] == -2.0)
        assert out.numpy("image_scale_x")[0] == pytest.approx(out.numpy("image_scale_y")[0], rel=0.1)


def test_letterbox_maps_points_back_to_the_original() -> None:
    img = np.zeros((100, 200, 3), dtype=np.uint8)
    img[40:60, 90:110] = 255  # a white square centred at (100, 50)
    h = Harness(size=(64, 64), dtype="uint8", layout="NHWC", color="GRAY", mean=(0.0,), std=(1.0,))
    out = h.run([encode(img, ".png")])
    tensor = out.numpy("pixels").reshape(64, 64)
    ys, xs = np.nonzero(tensor > 128)
    cx, cy = xs.mean(), ys.mean()
    ox, oy = out.numpy("image_offset_x")[0], out.numpy("image_offset_y")[0]
    sx, sy = out.numpy("image_scale_x")[0], out.numpy("image_scale_y")[0]
    assert (cx - ox) / sx == pytest.approx(100, abs=2) and (cy - oy) / sy == pytest.approx(50, abs=2)


def test_base64_text_is_decoded_as_json_carries_images() -> None:
    h = Harness(size=(8, 8))
    data = encode(picture(8, 8), ".png")
    out = h.run([base64.b64encode(data).decode(), "not base64!"], pa.string())
    assert out.ids.tolist() == [0]
    assert "not base64" in h.reasons()[1]


def _bomb_png(width: int, height: int) -> bytes:
    """A real small PNG whose header is rewritten to claim ``width`` x ``height``."""
    data = bytearray(encode(picture(4, 4), ".png"))
    data[16:24] = width.to_bytes(4, "big") + height.to_bytes(4, "big")
    return bytes(data)


def hostile() -> dict[str, tuple[bytes | None, str]]:
    """Inputs that must become dead letters, with a word their reason must hold."""
    jpeg = encode(picture(64, 64), ".jpg")
    png = encode(picture(64, 64), ".png")
    webp = encode(picture(64, 64), ".webp")
    corrupt = bytearray(jpeg)
    corrupt[len(corrupt) // 2 : len(corrupt) // 2 + 64] = b"\xff\xd9" * 32
    return {
        "zero-length": (b"", "empty"),
        "null": (None, "null"),
        "truncated jpeg": (jpeg[: len(jpeg) // 2], "truncated"),
        "truncated png": (png[: len(png) - 20], "truncated"),
        "truncated webp": (webp[: len(webp) // 2], "truncated"),
        "jpeg header only": (jpeg[:20], "truncated"),
        "bomb": (_bomb_png(100_000, 100_000), "too large"),
        "gif": (b"GIF89a\x01\x00\x01\x00\x00\x00\x00;", "unsupported"),
        "text": (b"hello, this is not an image", "not an image"),
        "zero size": (_bomb_png(0, 10), "0 x 10"),
        "corrupt jpeg": (bytes(corrupt), "corrupt"),
    }


def test_hostile_images_are_dead_letters_with_reasons_and_valid_ones_go_on() -> None:
    cases = hostile()
    good = encode(picture(40, 40), ".jpg")
    payloads = [good, *(data for data, _ in cases.values()), good]
    h = Harness(size=(16, 16))
    out = h.run(payloads)
    n = len(payloads)
    assert out.ids.tolist() == [0, n - 1]
    reasons = h.reasons()
    assert sorted(reasons) == list(range(1, n - 1))
    for i, (name, (_, word)) in enumerate(cases.items(), start=1):
        assert word in reasons[i], (name, reasons[i])
    stats = h.spec.counters.stats()
    assert stats["items"] == 2 and stats["refused"] == n - 2 and stats["units"] == 2 * 16 * 16


def test_pixel_limit_is_applied_from_the_header() -> None:
    h = Harness(size=(8, 8), max_pixels=100)
    out = h.run([encode(picture(10, 10), ".png"), encode(picture(11, 10), ".png")])
    assert out.ids.tolist() == [0]
    assert "110 pixels" in h.reasons()[1] or "10 x 11" in h.reasons()[1]


def test_a_batch_of_only_bad_rows_gives_an_empty_batch() -> None:
    h = Harness(size=(8, 8))
    out = h.run([b"", b"x"])
    assert out.num_rows == 0 and len(h.reasons()) == 2
    assert out.column("pixels").type.list_size == 3 * 8 * 8


def test_settings_are_checked() -> None:
    with pytest.raises(ConfigError, match="fit"):
        ImagePreprocess(fit="zoom")
    with pytest.raises(ConfigError, match="mean and std"):
        ImagePreprocess(color="GRAY")
    with pytest.raises(ConfigError, match="not binary"):
        Harness().run([1, 2], pa.int64())


SEEDS = {ext: encode(picture(24, 32, 7), ext) for ext in (".jpg", ".png", ".webp")}


@st.composite
def mutated(draw: st.DrawFn) -> bytes:
    """A valid image cut short, with bytes overwritten, or both; or random bytes."""
    if draw(st.booleans()):
        return draw(st.binary(max_size=512))
    data = bytearray(SEEDS[draw(st.sampled_from(sorted(SEEDS)))])
    for _ in range(draw(st.integers(0, 6))):
        at = draw(st.integers(0, len(data) - 1))
        data[at] = draw(st.integers(0, 255))
    return bytes(data[: draw(st.integers(0, len(data)))])


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(mutated(), min_size=1, max_size=6))
def test_fuzz_every_row_is_either_a_tensor_or_a_dead_letter(payloads: list[bytes]) -> None:
    h = Harness(size=(16, 16), max_pixels=1 << 20)
    out = h.run(payloads)
    kept, dead = set(out.ids.tolist()), set(h.reasons())
    assert kept.isdisjoint(dead) and kept | dead == set(range(len(payloads)))
    assert out.numpy("pixels").shape == (len(kept), 3 * 16 * 16) or not kept
    for i in kept:  # what was kept decodes on its own too
        decode_image(payloads[i])
    for i in dead:
        with pytest.raises(MediaError):
            data = payloads[i]
            decode_image(data, max_pixels=1 << 20)


def test_an_image_steps_counters_are_metrics_of_its_stage() -> None:
    from prometheus_client.core import Metric

    from aisp import CollectSink, Pipeline, TestingSource
    from aisp.observe.export.operators import counter_families, operator_counters

    p, out = Pipeline("img"), CollectSink(columns=["image_width"])
    rows = [{"image": encode(picture(20, 30), ".png")}, {"image": b"junk"}]
    p.source("src", TestingSource(rows)).apply("prep", ImagePreprocess(size=(8, 8))).sink("out", out)
    p.run()
    families: dict[str, Metric] = {f.name: f for f in counter_families(operator_counters(p.graph))}
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value for f in families.values() for s in f.samples
    }
    assert samples[("aisp_media_items_total", (("outcome", "decoded"), ("stage", "prep")))] == 1
    assert samples[("aisp_media_items_total", (("outcome", "refused"), ("stage", "prep")))] == 1
    assert samples[("aisp_media_units_total", (("stage", "prep"), ("unit", "pixels")))] == 64
    assert samples[("aisp_media_bytes_total", (("stage", "prep"),))] == len(rows[0]["image"]) + 4


def test_buckets_route_each_shape_to_a_step_of_its_own_size() -> None:
    from aisp import CollectSink, Pipeline, TestingSource
    from aisp.transform.media.images import ImageBuckets

    shapes = {"landscape": (30, 40), "portrait": (40, 30), "wide": (20, 40)}
    sizes = {"landscape": (12, 16), "portrait": (16, 12), "wide": (8, 16)}
    rows = [
        {"image": encode(picture(*shapes[name], seed=i), ".jpg" if i % 2 else ".png"), "want": name}
        for i, name in enumerate(["wide", "landscape", "portrait", "portrait", "wide", "landscape"] * 3)
    ]
    rows.append({"image": b"junk", "want": "landscape"})  # unreadable: first bucket, dead-lettered
    p = Pipeline("buckets")
    routes = (
        p.source("src", TestingSource(rows))
        .map_batch("bucket", ImageBuckets(sizes))
        .route("by_shape", list(sizes), column="bucket")
    )
    outs = {name: CollectSink(columns=["want", "bucket", "pixels"]) for name in sizes}
    for name, size in sizes.items():
        routes[name].apply(f"prep.{name}", ImagePreprocess(size=size)).sink(f"out.{name}", outs[name])
    summary = p.run()
    for name, (h, w) in sizes.items():
        got = outs[name].rows
        assert len(got) == 6 and {r["want"] for r in got} == {r["bucket"] for r in got} == {name}
        assert all(len(r["pixels"]) == 3 * h * w for r in got)
    assert summary.dead_letters_by_step == {"prep.landscape": 1}


def test_buckets_read_base64_text_and_need_a_size() -> None:
    from aisp.transform.media.images import ImageBuckets

    buckets = ImageBuckets({"square": (8, 8), "tall": (16, 8)})
    assert buckets.pick(base64.b64encode(encode(picture(40, 20), ".png")).decode()) == "tall"
    assert buckets.pick(None) == "square"
    with pytest.raises(ConfigError):
        ImageBuckets({})


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="no CPU affinity on this OS")
def test_one_thread_per_core_counts_the_cores_the_process_may_run_on() -> None:
    """``threads=0`` decodes on one thread per core of the process's affinity (a container's
    cpuset, ``taskset``), not per core of the machine."""
    code = (
        "import os; os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})\n"
        "from aisp.transform.media.common import cores; print(cores())"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "1"
