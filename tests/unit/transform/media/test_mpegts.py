"""The push demuxer gives FFmpeg's packets for any cut of a transport stream, through checkpoints,
and reports damage (no sync, lost packets, oversized PES) instead of raising."""

from __future__ import annotations

import io

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from aisp.bench.video import chunks, make_video
from aisp.transform.media.mpegts import PACKET, Pes, TsDemuxer

av = pytest.importorskip("av")


@pytest.fixture(scope="module")
def ts() -> bytes:
    tone = (0.2 * np.sin(2 * np.pi * 300 * np.arange(48000 * 2) / 48000)).astype(np.float32)
    return make_video(50, bframes=2, audio=(tone, 48000))


def _ffmpeg(data: bytes) -> dict[str, list[tuple[bytes, int | None]]]:
    got: dict[str, list[tuple[bytes, int | None]]] = {"video": [], "audio": []}
    with av.open(io.BytesIO(data)) as c:
        for p in c.demux():
            if p.size:
                got[p.stream.type].append((bytes(p), p.pts))
    return got


def _ours(parts: list[bytes], checkpoints: set[int] = frozenset()) -> tuple[dict[str, list[Pes]], list[str]]:
    d = TsDemuxer()
    out: list[Pes] = []
    errors: list[str] = []
    for i, part in enumerate(parts):
        got, bad = d.feed(part)
        out += got
        errors += bad
        if i in checkpoints:
            meta, blob = d.state()
            d = TsDemuxer.from_state(meta, blob)
    got, bad = d.finish()
    return {k: [p for p in out + got if p.kind == k] for k in ("video", "audio")}, errors + bad


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 2**32 - 1), count=st.integers(0, 80), every=st.integers(1, 7))
def test_any_cut_and_any_checkpoints_give_ffmpegs_packets(
    ts: bytes, seed: int, count: int, every: int
) -> None:
    rng = np.random.default_rng(seed)
    cuts = sorted(set(rng.integers(1, len(ts), count).tolist()))
    parts = chunks(ts, cuts)
    ours, errors = _ours(parts, set(range(0, len(parts), every)))
    assert errors == []
    for kind, packets in _ffmpeg(ts).items():
        assert [(p.payload, p.pts) for p in ours[kind]] == packets, (kind, seed)


def test_bytes_that_are_not_packets_are_skipped_and_reported(ts: bytes) -> None:
    garbage = bytes(np.random.default_rng(1).integers(0, 256, 5000, dtype=np.uint8)).replace(b"\x47", b"\x00")
    ours, errors = _ours([garbage[:3000], garbage[3000:] + ts])
    skipped = [
        int(e.split(": ")[1].split()[0]) for e in errors if e.startswith("not an MPEG transport stream")
    ]
    assert errors == [f"not an MPEG transport stream: {n} bytes without TS sync" for n in skipped]
    assert sum(skipped) == 5000  # each chunk's garbage reported with it, none of the stream
    assert len(ours["video"]) == len(_ffmpeg(ts)["video"])  # the stream after the garbage is whole


def test_a_lost_packet_drops_its_pes_packet_and_says_why(ts: bytes) -> None:
    d = TsDemuxer()
    d.feed(ts[: 40 * PACKET])
    video_pid = next(pid for pid, kind in d.pids.items() if kind == "video")
    # the tenth packet of the video PID after the first 40 is lost
    seen, lost = 0, -1
    for i in range(40, len(ts) // PACKET):
        pkt = ts[i * PACKET : (i + 1) * PACKET]
        if ((pkt[1] & 0x1F) << 8 | pkt[2]) == video_pid:
            seen += 1
            if seen == 10:
                lost = i
                break
    damaged = ts[: lost * PACKET] + ts[(lost + 1) * PACKET :]
    ours, errors = _ours([damaged])
    assert any("lost TS packets: continuity counter" in e and "video PES packet dropped" in e for e in errors)
    assert len(ours["video"]) == len(_ffmpeg(ts)["video"]) - 1
    assert len(ours["audio"]) == len(_ffmpeg(ts)["audio"])


def test_a_pes_packet_over_the_bound_is_dropped_as_it_grows(ts: bytes) -> None:
    d = TsDemuxer(max_pes_bytes=2000)
    out, errors = d.feed(ts)
    assert any("over 2000 bytes: dropped" in e for e in errors)
    assert all(len(p.payload) <= 2000 for p in out)
    assert max(len(b) for b in d._pes.values()) <= 2000 if d._pes else True
