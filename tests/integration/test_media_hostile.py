"""Held-out hostile images and audio through `aisp run` in a process of its own: each becomes a
dead letter with its reason, every valid item comes out exactly once, the process ends well and
its peak memory stays bounded (a 144-megapixel PNG bomb of a few hundred kilobytes is refused from
its header, before any pixel is made; a FLAC of 8 channels at 384 kHz, from its header, before
any sample is)."""

from __future__ import annotations

import base64
import json
import struct
import subprocess
import sys
import zlib
from pathlib import Path
from typing import Any

import numpy as np

from tests.unit.transform.media.test_audio import signal, wav
from tests.unit.transform.media.test_audio_limits import with_rate
from tests.unit.transform.media.test_images import encode, hostile, picture
from tests.unit.transform.media.test_images_real import asymmetric, pillow, progressive
from tests.unit.transform.media.test_reasons import ADDRESS

PIPELINE = """
import msgspec
from aisp import NullSink, Pipeline, TestingSource
from aisp.transform.media.audio import AudioDecode
from aisp.transform.media.images import ImagePreprocess


class Row(msgspec.Struct):
    id: str
    data: bytes


def build(kind: str = "image") -> Pipeline:
    p = Pipeline("hostile", output_columns=["id"])
    src = p.source("in", TestingSource([]), schema=Row)
    if kind == "image":
        step = ImagePreprocess(column="data", size=(64, 64))
    else:
        step = AudioDecode(column="data", max_seconds=30.0)
    src.apply("decode", step).sink("out", NullSink())
    return p
"""


def png_bomb(side: int = 12000) -> bytes:
    """A real grayscale PNG of ``side`` x ``side`` zeros: a few hundred kilobytes that decode to
    ``side ** 2`` bytes."""
    packer = zlib.compressobj(9)
    row = bytes(side + 1)  # filter byte + pixels
    idat = b"".join(packer.compress(row) for _ in range(side)) + packer.flush()

    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    header = struct.pack(">IIBBBBB", side, side, 8, 0, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", idat) + chunk(b"IEND", b"")


def flac_bomb(seconds: float, channels: int, rate: int) -> bytes:
    """A real FLAC of silence: under a second's worth of kilobytes per second, whatever it
    decodes to (29 s of 8 channels at 384 kHz: 89 million samples, 356 MB as float32)."""
    import io

    import soundfile as sf

    buf = io.BytesIO()
    block = np.zeros((rate, channels), dtype=np.int16)
    with sf.SoundFile(buf, "w", samplerate=rate, channels=channels, format="FLAC", subtype="PCM_16") as f:
        for _ in range(int(seconds)):
            f.write(block)
    return buf.getvalue()


def run(
    tmp: Path, kind: str, rows: list[tuple[str, bytes]]
) -> tuple[list[str], list[dict[str, Any]], dict[str, Any]]:
    (tmp / "pipeline.py").write_text(PIPELINE)
    lines = [json.dumps({"id": i, "data": base64.b64encode(d).decode()}) for i, d in rows]
    (tmp / "in.jsonl").write_text("\n".join(lines) + "\n")
    cmd = [sys.executable, "-m", "aisp.cli", "run", str(tmp / "pipeline.py"), "--param", f"kind={kind}",
           "--input", str(tmp / "in.jsonl"), "--output", str(tmp / "out.jsonl"),
           "--dead-letter", str(tmp / "dl.jsonl"), "--summary-json", str(tmp / "summary.json")]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    out = [json.loads(x)["id"] for x in (tmp / "out.jsonl").read_text().splitlines()]
    dead = [json.loads(x) for x in (tmp / "dl.jsonl").read_text().splitlines()]
    return out, dead, json.loads((tmp / "summary.json").read_text())


def test_hostile_images_are_dead_letters_valid_ones_come_out_once_memory_bounded(tmp_path: Path) -> None:
    bomb = png_bomb()
    assert len(bomb) < 1 << 20
    cases = {name: data for name, (data, _) in hostile().items() if data is not None}
    cases["real bomb"] = bomb
    cases["4000 scans"] = progressive(4000, size=256)
    rng = np.random.default_rng(0)
    rows: list[tuple[str, bytes]] = [
        (
            "ok-motion-photo",
            encode(picture(300, 400), ".jpg") + b"\x00\x00\x00\x18ftypmp42" + rng.bytes(1 << 21),
        ),
        ("ok-png-then-bytes", encode(picture(30, 40), ".png") + b"trailing bytes"),
        ("ok-sideways", pillow(asymmetric(), orientation=6)),
    ]
    for k in range(240):  # valid images of every codec among the hostile ones, 12 rounds
        ext = (".jpg", ".png", ".webp")[k % 3]
        rows.append(
            (f"ok-{k}", encode(picture(int(rng.integers(16, 400)), int(rng.integers(16, 400)), k), ext))
        )
        if k % 20 == 0:
            rows += [(f"bad-{k}-{name}", data) for name, data in cases.items()]
    out, dead, summary = run(tmp_path, "image", rows)
    assert sorted(out) == sorted(i for i, _ in rows if i.startswith("ok-"))  # each once
    assert sorted(d["row"]["id"] for d in dead) == sorted(i for i, _ in rows if i.startswith("bad-"))
    assert all(d["reason"] and d["step"] == "decode" for d in dead)
    assert any("too large" in d["reason"] for d in dead if d["row"]["id"].endswith("real bomb"))
    assert all("too many scans" in d["reason"] for d in dead if d["row"]["id"].endswith("4000 scans"))
    assert not [d["reason"] for d in dead if ADDRESS.search(d["reason"])]
    assert summary["peak_rss_mb"] < 600, summary["peak_rss_mb"]


def test_hostile_audio_is_dead_letters_valid_audio_comes_out_once(tmp_path: Path) -> None:
    y = signal(0.5)
    good = {"wav": wav(y), "flac": wav(y, fmt="FLAC"), "ogg": wav(y, fmt="OGG", subtype="VORBIS")}
    long_header = bytearray(wav(signal(0.1)))
    long_header[40:44] = struct.pack("<I", 0x7FFFFFF0)  # a data chunk claiming 2 GB
    bad = {
        "empty": b"",
        "truncated": good["wav"][: len(good["wav"]) // 3],
        "claims 2 GB": bytes(long_header),
        "text": b"hello",
        "image": encode(picture(8, 8), ".png"),
        "too long": wav(np.zeros(16000 * 40, dtype=np.float32)),
        "corrupt flac": good["flac"][:60] + bytes(400) + good["flac"][460:],
        "rate 1e9": with_rate(good["wav"], 1_000_000_000),
        "nan": wav(np.where(np.arange(len(y)) == 99, np.nan, y).astype(np.float32), subtype="FLOAT"),
        "bomb": flac_bomb(29.0, 8, 384_000),
    }
    rows = [(f"ok-{k}-{n}", d) for k in range(20) for n, d in good.items()]
    rows += [(f"bad-{n}", d) for n, d in bad.items()]
    out, dead, summary = run(tmp_path, "audio", rows)
    assert sorted(out) == sorted(i for i, _ in rows if i.startswith("ok-"))
    reasons = {d["row"]["id"]: d["reason"] for d in dead}
    assert sorted(reasons) == sorted(i for i, _ in rows if i.startswith("bad-"))
    assert "truncated" in reasons["bad-claims 2 GB"] and "too long" in reasons["bad-too long"]
    assert "impossible sample rate" in reasons["bad-rate 1e9"] and "not finite" in reasons["bad-nan"]
    assert "too large" in reasons["bad-bomb"], reasons["bad-bomb"]
    assert not [r for r in reasons.values() if ADDRESS.search(r)]
    assert summary["peak_rss_mb"] < 600, summary["peak_rss_mb"]
