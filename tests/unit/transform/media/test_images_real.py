"""Images as real devices and tools write them: data after the image's end (motion photos),
progressive JPEGs and their scans, EXIF orientation."""

from __future__ import annotations

import io
import re

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from PIL import Image, ImageOps

from aisp.transform.media.common import MediaError
from aisp.transform.media.image_formats import MAX_SCANS, image_info
from aisp.transform.media.images import ImageBuckets, decode_image
from tests.unit.transform.media.test_images import Harness, encode, picture


def pillow(img: np.ndarray, fmt: str = "JPEG", orientation: int | None = None, **params: object) -> bytes:
    """``img`` (RGB) written by Pillow, with an EXIF orientation tag if given."""
    buf = io.BytesIO()
    if orientation is not None:
        exif = Image.Exif()
        exif[0x0112] = orientation
        params["exif"] = exif.tobytes()
    Image.fromarray(img).save(buf, fmt, **params)
    return buf.getvalue()


def asymmetric(h: int = 24, w: int = 40) -> np.ndarray:
    """An RGB image no flip or turn leaves alike: smooth gradients and a block in one corner."""
    y, x = np.mgrid[0:h, 0:w]
    img = np.stack([x * 255 // (w - 1), y * 255 // (h - 1), np.full_like(x, 60)], axis=2).astype(np.uint8)
    img[: h // 3, : w // 4] = (250, 250, 20)
    return img


def progressive(extra_scans: int = 0, *, size: int = 48) -> bytes:
    """A progressive JPEG (Pillow's, about 10 scans) with its shortest scan (a scan header and
    its entropy-coded data, tens of bytes) written ``extra_scans`` more times before the end."""
    data = pillow(picture(size, size, 3), progressive=True, quality=90)
    end = len(data) - 2
    assert data[end:] == b"\xff\xd9"
    scans = []
    for found in re.finditer(rb"\xff\xda", data):
        body = found.start() + 2 + int.from_bytes(data[found.start() + 2 : found.start() + 4], "big")
        stop = re.compile(rb"\xff[\x01-\xcf\xd8-\xfe]").search(data, body)
        assert stop is not None
        scans.append(data[found.start() : stop.start()])
    return data[:end] + min(scans, key=len) * extra_scans + data[end:]


# --- data after the image's end ---------------------------------------------------------------

SOURCES = {
    "jpeg": encode(picture(30, 44, 1), ".jpg"),
    "png": encode(picture(30, 44, 2), ".png"),
    "webp": encode(picture(30, 44, 3), ".webp"),
    "webp lossless": encode(picture(30, 44, 4), ".webp", IMWRITE_WEBP_QUALITY=101),
    "progressive jpeg": progressive(),
    "jpeg with exif": pillow(asymmetric(), orientation=6, quality=90),
    "png with exif": pillow(asymmetric(), "PNG", orientation=3),
}


@st.composite
def trailing(draw: st.DrawFn) -> bytes:
    """Bytes of any length, from none to megabytes: chosen ones (markers, signatures) then a
    seeded random run."""
    head = draw(
        st.one_of(
            st.binary(max_size=64),
            st.sampled_from([b"\xff\xd9", b"\xff\xd8\xff\xe0", b"IEND", b"\x00\x00\x00\x00IEND\xaeB`\x82"]),
            st.sampled_from(sorted(SOURCES.values())),  # another image after the first
        )
    )
    length = draw(st.one_of(st.integers(0, 2048), st.integers(0, 3 << 20)))
    seed = draw(st.integers(0, 2**32 - 1))
    return head + np.random.default_rng(seed).integers(0, 256, length, dtype=np.uint8).tobytes()


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from(sorted(SOURCES)), trailing())
def test_any_bytes_after_the_end_leave_the_pixels_as_they_are(name: str, tail: bytes) -> None:
    data = SOURCES[name]
    want = decode_image(data)
    np.testing.assert_array_equal(decode_image(data + tail), want)
    info = image_info(data + tail)
    assert info.end == len(data) and info.size() == image_info(data).size()


def test_a_motion_photo_is_read_as_its_still_image() -> None:
    """A phone's motion photo: a JPEG, then an MP4 video of a megabyte or more."""
    still = encode(picture(60, 80, 5), ".jpg")
    video = b"\x00\x00\x00\x18ftypmp42" + np.random.default_rng(7).bytes(1_500_000)
    h = Harness(size=(30, 40), dtype="uint8", layout="NHWC")
    out = h.run([still + video, encode(picture(20, 20), ".png") + b"12345", still])
    assert not h.reasons(), h.reasons()
    assert out.ids.tolist() == [0, 1, 2]
    np.testing.assert_array_equal(out.numpy("pixels")[0], out.numpy("pixels")[2])


def test_an_image_cut_before_its_end_is_still_truncated() -> None:
    for data in (SOURCES["jpeg"], SOURCES["progressive jpeg"], SOURCES["png"]):
        for cut in (len(data) - 2, len(data) // 2, 40):
            with pytest.raises(MediaError, match="truncated"):
                image_info(data[:cut])


# --- scans of progressive JPEGs ---------------------------------------------------------------


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 600), st.integers(1, 300))
def test_scans_are_counted_and_refused_past_the_limit(extra: int, limit: int) -> None:
    base = image_info(progressive()).scans
    assert 2 <= base <= 20  # what an encoder writes
    data = progressive(extra)
    if base + extra > limit:
        with pytest.raises(MediaError, match=f"too many scans: more than {limit}"):
            image_info(data, max_scans=limit)
    else:
        assert image_info(data, max_scans=limit).scans == base + extra


def test_thousands_of_scans_are_refused_before_decoding(monkeypatch: pytest.MonkeyPatch) -> None:
    """4,000 scans take a decoder seconds (each is a pass over the image); the header pass
    refuses them, and the decoder never sees the file."""
    import simplejpeg

    def never(*args: object, **kwargs: object) -> None:
        raise AssertionError("the decoder was called")

    bomb = progressive(4000, size=256)
    monkeypatch.setattr(simplejpeg, "decode_jpeg", never)
    h = Harness(size=(16, 16))
    out = h.run([bomb])
    assert out.num_rows == 0
    assert h.reasons()[0] == f"JPEG has too many scans: more than {MAX_SCANS} (limit {MAX_SCANS})"
    assert Harness(size=(16, 16), max_scans=10).spec.max_scans == 10


def test_a_progressive_jpeg_decodes_as_pillow_decodes_it() -> None:
    data = progressive()
    ref = np.asarray(Image.open(io.BytesIO(data)).convert("RGB"), dtype=np.int16)
    assert np.abs(decode_image(data).astype(np.int16) - ref).mean() < 2.0


# --- EXIF orientation -------------------------------------------------------------------------


def upright_by_pillow(data: bytes) -> np.ndarray:
    transposed = ImageOps.exif_transpose(Image.open(io.BytesIO(data)))
    assert transposed is not None
    return np.asarray(transposed.convert("RGB"), dtype=np.int16)


ORIENTED = {
    "jpeg": {"quality": 95, "subsampling": 0},
    "png": {},
    "webp": {"lossless": True},
}


@pytest.mark.parametrize("orientation", range(1, 9))
@pytest.mark.parametrize("fmt", sorted(ORIENTED))
def test_exif_orientation_turns_pixels_as_pillow_does(fmt: str, orientation: int) -> None:
    img = asymmetric()
    data = pillow(img, fmt.upper(), orientation, **ORIENTED[fmt])
    assert image_info(data).orientation == orientation
    ref = upright_by_pillow(data)
    got = decode_image(data).astype(np.int16)
    assert got.shape == ref.shape
    assert np.abs(got - ref).mean() < 2.0, orientation  # JPEG: decoders differ by a level or two
    stored = decode_image(data, exif_orientation=False)
    assert stored.shape == img.shape


@pytest.mark.parametrize("orientation", range(1, 9))
def test_the_image_step_gives_upright_tensors_and_sizes(orientation: int) -> None:
    data = pillow(asymmetric(), "JPEG", orientation, quality=95, subsampling=0)
    ref = upright_by_pillow(data)
    h, w = ref.shape[:2]
    step = Harness(size=(h, w), fit="stretch", dtype="uint8", layout="NHWC")
    out = step.run([data])
    assert (out.numpy("image_height")[0], out.numpy("image_width")[0]) == (h, w)
    got = out.numpy("pixels").reshape(h, w, 3).astype(np.int16)
    assert np.abs(got - ref).mean() < 2.0
    as_stored = Harness(size=(24, 40), exif_orientation=False).run([data])
    assert (as_stored.numpy("image_height")[0], as_stored.numpy("image_width")[0]) == (24, 40)


def test_a_portrait_photo_stored_sideways_goes_to_the_portrait_bucket() -> None:
    sideways = pillow(asymmetric(30, 40), orientation=6)  # stored landscape, shown portrait
    buckets = ImageBuckets({"landscape": (30, 40), "portrait": (40, 30)})
    assert buckets.pick(sideways) == "portrait"
    assert buckets.pick(pillow(asymmetric(30, 40), orientation=1)) == "landscape"


def test_unreadable_exif_is_orientation_one() -> None:
    data = bytearray(pillow(asymmetric(), orientation=6))
    at = data.index(b"Exif\x00\x00") + 6
    data[at : at + 2] = b"XX"  # no byte order: the EXIF block does not parse
    assert image_info(bytes(data)).orientation == 1
    assert decode_image(bytes(data)).shape == (24, 40, 3)
