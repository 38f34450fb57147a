"""Video decoding: every frame of files in the common containers, with its time; live MPEG-TS
streams cut anywhere, in any batches, through checkpoints, give the frames and sound of the whole;
hostile files and chunks go to the dead letters with their reasons, and the rest goes on."""

from __future__ import annotations

import resource
from pathlib import Path
from typing import Any

import numpy as np
import orjson
import pyarrow as pa
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from aisp.batch import ID, KEY, Batch
from aisp.bench.video import chunks, frame_number, make_video
from aisp.errors import ConfigError
from aisp.state.keyed import KeyIndex
from aisp.transform.media.images import ImagePreprocess
from aisp.transform.media.video import AUDIO_PORT, VideoDecode
from aisp.transform.operators import OperatorContext

pytest.importorskip("av")

FPS = 25
Frame = tuple[int, float, int, bool]  # number shown, pts_s, frame_index, keyframe


class Decoding:
    """A VideoDecode step as a pipeline runs it: batches in, frames, audio and dead letters out."""

    def __init__(self, **options: Any) -> None:
        self.index = KeyIndex()
        self.dead: list[tuple[int, str]] = []

        def dead_letter(batch: Batch, step: str, reason: str, fields: Any = None) -> None:
            self.dead += [(i, reason) for i in batch.pylist(ID)]

        self.ctx = OperatorContext("video", dead_letter, {"s": self.index})
        self.spec = VideoDecode(**options)
        self.op: Any = self.spec.build(self.ctx)
        self.frames: dict[str, list[Frame]] = {}
        self.audio: dict[str, list[np.ndarray]] = {}
        self.ids: list[int] = []
        self.pixels = 0

    def feed(self, rows: list[tuple[str | None, bytes | None]], first_id: int = 0) -> None:
        streams = pa.array([s for s, _ in rows], pa.string())
        batch = Batch.from_columns(
            {"stream": streams, "video": pa.array([v for _, v in rows], pa.binary())},
            ids=np.arange(first_id, first_id + len(rows)),
        )
        self._take(self.op.process(batch.with_columns({KEY: self.index.encode(streams)})))

    def restart(self) -> None:
        """A checkpoint taken now, restored into a new step (as after kill -9)."""
        state = self.op.snapshot()
        self.op = self.spec.build(self.ctx)
        self.op.restore(state)

    def end(self) -> None:
        self._take(self.op.flush())

    def _take(self, emitted: list[tuple[str, Batch]]) -> None:
        for port, out in emitted:
            names = out.pylist("stream")
            if port == AUDIO_PORT:
                for name, samples in zip(names, out.pylist("samples"), strict=True):
                    self.audio.setdefault(name, []).append(np.asarray(samples, np.float32))
                continue
            self.ids += out.pylist(ID)
            cols = [
                out.pylist(c)
                for c in ("frame", "frame_width", "frame_height", "pts_s", "frame_index", "keyframe")
            ]
            for name, data, w, h, t, i, key in zip(names, *cols, strict=True):
                assert len(data) == w * h * 3
                self.pixels += w * h
                rgb = np.frombuffer(data, np.uint8).reshape(h, w, 3)
                self.frames.setdefault(name, []).append((frame_number(rgb), round(t, 6), i, key))

    def sound(self, name: str) -> np.ndarray:
        return np.concatenate(self.audio.get(name, [np.zeros(0, np.float32)]))


def _tone(seconds: float, rate: int = 48000, hz: float = 440.0) -> np.ndarray:
    return (0.3 * np.sin(2 * np.pi * hz * np.arange(int(seconds * rate)) / rate)).astype(np.float32)


@pytest.fixture(scope="module")
def live() -> dict[str, bytes]:
    """Three live streams: H.264 with B-frames and AAC sound, key frames every 1 s or 0.4 s."""
    return {
        "a": make_video(60, bframes=2, audio=(_tone(2.4), 48000)),
        "b": make_video(45, gop=10, audio=(_tone(1.8, hz=220), 48000)),
        "c": make_video(70, bframes=1, gop=30, width=160, height=96, audio=(_tone(2.8, hz=660), 48000)),
    }


@pytest.fixture(scope="module")
def whole(live: dict[str, bytes]) -> Decoding:
    d = Decoding(stream="stream", audio=True)
    for i, (name, data) in enumerate(live.items()):
        d.feed([(name, data)], first_id=i)
    d.end()
    assert d.dead == []
    return d


@pytest.mark.parametrize(
    ("container", "codec", "bframes"),
    [("mp4", "libx264", 2), ("matroska", "libvpx-vp9", 0), ("avi", "mjpeg", 0), ("mpegts", "libx264", 1)],
)
def test_files_in_each_container_give_every_frame_with_its_time(
    container: str, codec: str, bframes: int
) -> None:
    data = make_video(30, codec=codec, container=container, gop=10, bframes=bframes)
    d = Decoding()
    d.feed([("clip", data)])
    assert d.dead == []
    frames = d.frames["clip"]
    assert [f[0] for f in frames] == list(range(30))  # every frame, in order, the right pictures
    assert [round(f[1] - frames[0][1], 6) for f in frames] == [round(i / FPS, 6) for i in range(30)]
    assert 0 <= frames[0][1] < 0.1  # from the file's start
    assert [f[2] for f in frames] == list(range(30))
    assert all(f[3] for f in frames[::10])  # the key frames every 10 (MJPEG: all are)
    assert len(set(d.ids)) == 30


def test_fps_key_frames_and_size_pick_and_scale_frames() -> None:
    data = make_video(50, gop=20)
    d = Decoding(fps=3)
    d.feed([("clip", data)])
    # the first frame at or after each third of a second
    assert [f[0] for f in d.frames["clip"]] == [0, 9, 17, 25, 34, 42]
    d = Decoding(keyframes=True, size=(48, 64))
    d.feed([("clip", data)])
    assert [f[0] for f in d.frames["clip"]] == [0, 20, 40]
    assert d.pixels == 3 * 48 * 64


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 2**32 - 1), chunk_bytes=st.sampled_from([188, 1000, 7000, 30000]))
def test_live_streams_cut_anywhere_in_any_batches_through_restarts_give_the_whole_streams(
    live: dict[str, bytes], whole: Decoding, seed: int, chunk_bytes: int
) -> None:
    rng = np.random.default_rng(seed)
    pieces: list[tuple[str, bytes]] = []
    for name, data in live.items():
        cuts = sorted(set(rng.integers(1, len(data), max(1, len(data) // chunk_bytes)).tolist()))
        pieces += [(name, p) for p in chunks(data, cuts)]
    order = np.argsort(
        rng.random(len(pieces)) + np.array([i for i, _ in enumerate(pieces)]) / len(pieces) * 3
    )
    # each stream's chunks keep their order; the streams interleave
    by_stream: dict[str, list[bytes]] = {}
    for name, p in pieces:
        by_stream.setdefault(name, []).append(p)
    queue = [(name, by_stream[name].pop(0)) for name, _ in (pieces[i] for i in order)]
    d = Decoding(stream="stream", audio=True)
    at = 0
    while at < len(queue):
        n = int(rng.integers(1, 6))
        d.feed(queue[at : at + n], first_id=at)
        at += n
        if rng.random() < 0.3:
            d.restart()
    d.end()
    assert d.dead == []
    assert d.frames == whole.frames, seed
    for name in live:
        a, b = d.sound(name), whole.sound(name)
        assert len(a) == len(b)
        # the same but for bands coded as noise (AAC's perceptual noise substitution draws
        # from a random state no checkpoint carries): under -40 dB of full scale
        assert np.abs(a - b).max() < 1e-2


def test_whole_streams_decode_every_frame_and_their_sound(live: dict[str, bytes], whole: Decoding) -> None:
    assert [f[0] for f in whole.frames["a"]] == list(range(60))
    b = whole.frames["b"]  # its first frame a little after the stream's start (the sound's)
    assert [round(f[1] - b[0][1], 6) for f in b] == [round(i / FPS, 6) for i in range(45)]
    assert 0 < b[0][1] < 0.05
    assert whole.frames["c"][0][3] and whole.frames["c"][30][3]
    sound = whole.sound("a")
    assert 2.3 * 48000 < len(sound) < 2.5 * 48000
    spectrum = np.abs(np.fft.rfft(sound[4800:52800]))
    assert abs(np.argmax(spectrum) * 48000 / 48000 - 440) <= 2  # the tone that went in


def test_a_stream_joined_mid_way_starts_at_its_next_key_frame(live: dict[str, bytes]) -> None:
    data = live["b"]  # key frames every 10 frames
    d = Decoding(stream="stream")
    d.feed([("b", data[len(data) // 3 :])])
    d.end()
    frames = d.frames["b"]
    assert frames[0][3] and frames[0][0] % 10 == 0 and frames[0][0] > 0
    assert [f[0] for f in frames] == list(range(frames[0][0], 45))
    assert d.dead == []


def _patched(data: bytes, old: bytes, new: bytes) -> bytes:
    assert old in data
    return data.replace(old, new, 1)


def test_hostile_files_go_to_the_dead_letters_with_reasons_and_the_others_on() -> None:
    good = make_video(10, container="mp4")
    mkv = make_video(20, codec="libvpx-vp9", container="matroska")
    rows: dict[str, tuple[bytes | None, str]] = {
        "null": (None, "no video (null)"),
        "empty": (b"", "empty video (zero bytes)"),
        "garbage": (bytes(range(256)) * 40, "not a video file FFmpeg reads"),
        "truncated mp4": (good[: len(good) // 2], "not a video file FFmpeg reads"),
        "truncated mkv": (mkv[: len(mkv) * 2 // 3], "truncated video"),
        "truncated ts": (make_video(10)[:-100], "truncated transport stream"),
        "big frames": (
            make_video(2, width=1280, height=720, container="mp4"),
            "video frame too large: 1280 x 720",
        ),
        "unknown codec": (
            make_video(5, codec="mjpeg", container="avi").replace(b"MJPG", b"ZZZZ"),
            "unsupported video codec",
        ),
        "too long": (make_video(60, container="mp4"), "video too long: 2.4 s (limit 2.0)"),
        "too fast": (make_video(10, fps=100, container="mp4"), "video frame rate over 60"),
        "too many bytes": (bytes(3 << 20), "video input too large"),
        "no video": (_audio_only(), "no video stream in the file"),
    }
    d = Decoding(max_pixels=640 * 480, max_seconds=2.0, max_fps=60, max_bytes=2 << 20)
    names = list(rows)
    d.feed([(name, rows[name][0]) for name in names] + [("good", good)])
    reasons = dict(d.dead)
    for i, name in enumerate(names):
        assert reasons.get(i, "").startswith(rows[name][1]) or rows[name][1] in reasons.get(i, ""), (
            name,
            reasons.get(i),
        )
    assert set(d.frames) == {"good"} and len(d.frames["good"]) == 10
    d = Decoding(max_decoded_bytes=5 * 320 * 240 * 3 // 2)
    d.feed([("x", good)])
    assert d.dead[0][1].startswith("decoded pictures over") and not d.frames


def _audio_only() -> bytes:
    import io

    import av

    buf = io.BytesIO()
    with av.open(buf, "w", format="matroska") as out:
        s = out.add_stream("libopus", rate=48000)
        s.layout = "mono"
        tone = _tone(0.5)
        for at in range(0, len(tone), 960):
            f = av.AudioFrame.from_ndarray(tone[None, at : at + 960], format="flt", layout="mono")
            f.sample_rate, f.pts = 48000, at
            for p in s.encode(f):
                out.mux(p)
        for p in s.encode():
            out.mux(p)
    return buf.getvalue()


def test_hostile_chunks_go_to_the_dead_letters_and_the_stream_goes_on(live: dict[str, bytes]) -> None:
    data = live["b"]
    d = Decoding(stream="stream")
    half = (len(data) // 2 // 188) * 188
    d.feed(
        [("b", data[:half]), ("b", b"this is not a transport stream" * 20), ("b", data[half:]), ("z", None)]
    )
    d.end()
    reasons = dict(d.dead)
    assert reasons[1].startswith("not an MPEG transport stream: 600 bytes without TS sync")
    assert reasons[3] == "no video (null)"
    assert [f[0] for f in d.frames["b"]] == list(range(45))  # the garbage between did not hurt
    # a key frame larger than the limit: refused before decoding, and the stream's later chunks too
    d = Decoding(stream="stream", max_pixels=100 * 100)
    d.feed([("b", data[:half]), ("b", data[half:])])
    assert d.dead[0][1].startswith("video frame too large: 320 x 240 pixels")
    assert d.dead[1][1].startswith("stream refused earlier: video frame too large")
    assert not d.frames
    # a codec this demuxer does not hand on (the PMT's stream type 0x1b patched to AVS, 0x42)
    d = Decoding(stream="stream")
    pmt = b"\xe1\x00\xf0\x00\x1b\xe1\x00"  # PCR PID, no programme info, H.264 on PID 0x100
    assert data.count(pmt) > 1  # the map is repeated: each copy patched
    d.feed([("b", data.replace(pmt, pmt[:4] + b"\x42" + pmt[5:]))])
    assert d.dead[0][1] == "stream refused: unsupported video codec: MPEG-TS stream type 0x42"
    # a lost TS packet: its frame is lost, said, and the decoder goes on
    d = Decoding(stream="stream")
    cut = 300 * 188
    d.feed([("b", data[:cut] + data[cut + 188 :])])
    d.end()
    assert any("lost TS packets" in r for _, r in d.dead)
    assert len(d.frames["b"]) >= 40


def test_settings_are_checked() -> None:
    with pytest.raises(ConfigError, match="fps"):
        VideoDecode(fps=-1)
    with pytest.raises(ConfigError, match="size"):
        VideoDecode(size=(0, 10))
    with pytest.raises(ConfigError, match="max_pixels"):
        VideoDecode(max_pixels=0)
    assert VideoDecode(audio=True).ports == ("default", AUDIO_PORT) or len(VideoDecode(audio=True).ports) == 2


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    data=st.data(),
    kind=st.sampled_from(["mp4", "matroska", "mpegts", "stream"]),
    edits=st.integers(1, 12),
)
def test_mutated_containers_and_chunks_never_stop_the_step_or_exceed_the_bounds(
    mutants: dict[str, bytes], data: Any, kind: str, edits: int
) -> None:
    blob = bytearray(mutants[kind])
    for _ in range(edits):
        op = data.draw(st.sampled_from(["flip", "cut", "splice", "zero"]))
        at = data.draw(st.integers(0, max(0, len(blob) - 1)))
        if op == "flip" and blob:
            blob[at] ^= 1 << data.draw(st.integers(0, 7))
        elif op == "cut":
            del blob[at : at + data.draw(st.integers(1, 4000))]
        elif op == "splice":
            blob[at:at] = blob[: data.draw(st.integers(1, 2000))]
        elif blob:
            blob[at : at + 64] = bytes(min(64, len(blob) - at))
    limit = 400 * 300
    d = Decoding(
        stream="stream" if kind == "stream" else None,
        audio=True,
        max_pixels=limit,
        max_decoded_bytes=64 << 20,
    )
    if kind == "stream":
        cuts = sorted(set(data.draw(st.lists(st.integers(1, max(1, len(blob) - 1)), max_size=20))))
        parts = chunks(bytes(blob), cuts)
        d.feed([("s", p) for p in parts])
        d.end()
    else:
        d.feed([("f", bytes(blob))])
    # decoded or refused with a reason; never more pixels than the limits allow
    assert all(isinstance(r, str) and r for _, r in d.dead)
    assert d.pixels <= (64 << 20) * 2 // 3
    assert all(len(v) <= 200 for v in d.frames.values())


@pytest.fixture(scope="module")
def mutants() -> dict[str, bytes]:
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    small = {"width": 160, "height": 96, "gop": 8}
    made = {
        "mp4": make_video(24, container="mp4", bframes=1, **small),
        "matroska": make_video(24, codec="libvpx-vp9", container="matroska", **small),
        "mpegts": make_video(24, audio=(_tone(1.0), 48000), **small),
        "stream": make_video(24, audio=(_tone(1.0), 48000), bframes=2, **small),
    }
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 1 << 20  # KB
    return made


def test_rgb24_frames_make_image_tensors_as_files_would(live: dict[str, bytes]) -> None:
    d = Decoding(keyframes=True)
    batch = Batch.from_columns(
        {"video": pa.array([make_video(3, container="mp4")], pa.binary())}, ids=np.arange(1)
    )
    [(_, frames)] = d.op.process(batch)
    dead: list[str] = []
    ctx = OperatorContext("prep", lambda b, s, reason, f=None: dead.append(reason), {})
    prep: Any = ImagePreprocess(
        column="frame", input="rgb24", size=(60, 80), dtype="uint8", layout="NHWC"
    ).build(ctx)
    [(_, out)] = prep.process(frames)
    tensor = np.asarray(out.pylist("pixels")[0], np.uint8).reshape(60, 80, 3)
    assert frame_number(tensor) == 0 and out.pylist("image_width") == [320]
    bad = frames.with_columns({"frame_width": np.array([321])})
    assert prep.process(bad)[0][1].num_rows == 0
    assert dead == ["raw frame of 230400 bytes is not 321 x 240 x 3 (RGB24)"]
    with pytest.raises(ConfigError, match="frame size columns"):
        prep.process(frames.drop(["frame_width"]))


def test_a_pipeline_decodes_live_streams_into_tensors_and_sound_and_counts_its_work(
    live: dict[str, bytes], whole: Decoding, tmp_path: Path
) -> None:
    """Chunks of two streams through a key by stream, VideoDecode with its audio port, an image
    step on the frames and a keyed Resample on the sound, in a running pipeline; a garbage chunk
    is a dead letter; the step's counters are metrics of its stage."""
    from aisp import CollectSink, Pipeline, TestingSource
    from aisp.observe.export.operators import counter_families, operator_counters
    from aisp.transform.media.resample import Resample

    rows = []
    for name in ("a", "b"):
        data = live[name]
        rows += [
            {"stream": name, "seq": k, "video": data[at : at + 4000]}
            for k, at in enumerate(range(0, len(data), 4000))
        ]
    rows.sort(key=lambda r: r["seq"])
    rows.insert(7, {"stream": "a", "seq": -1, "video": b"garbage!" * 30})
    p = Pipeline("video")
    frames_out = CollectSink(columns=["stream", "pts_s", "frame_index", "image_width"])
    sound_out = CollectSink(columns=["stream", "samples"])
    keyed = p.source("src", TestingSource(rows, batch_rows=5)).key_by("by_stream", "stream")
    video = keyed.apply("video", VideoDecode(stream="stream", audio=True, fps=5))
    video.apply("prep", ImagePreprocess(column="frame", input="rgb24", size=(96, 128))).sink(
        "frames", frames_out
    )
    sound = video.output(AUDIO_PORT).key_by("by_stream_audio", "stream")
    sound.apply("resample", Resample(input_rate=48000, sample_rate=16000)).sink("sound", sound_out)
    p.run(dead_letter=str(tmp_path / "dead.jsonl"))
    dead = [orjson.loads(line) for line in (tmp_path / "dead.jsonl").read_bytes().splitlines()]
    # the garbage chunk, and the one after it, whose first packet it cut
    assert any(d["reason"].startswith("not an MPEG transport stream") for d in dead)
    assert all("video" in d["step"] for d in dead) and 1 <= len(dead) <= 2
    for name in ("a", "b"):
        got = sorted((r["pts_s"], r["frame_index"]) for r in frames_out.rows if r["stream"] == name)
        # five frames a second: the first frame at or after each fifth of a second of the stream
        times = [t for _, t, _, _ in whole.frames[name]]
        want = sorted({min(t for t in times if t >= k / 5 - 1e-9) for k in range(int(times[-1] * 5) + 1)})
        assert [round(t, 6) for t, _ in got] == want
        assert all(r["image_width"] == 320 for r in frames_out.rows)
        heard = sum(len(r["samples"]) for r in sound_out.rows if r["stream"] == name)
        assert abs(heard - len(whole.sound(name)) / 3) < 100  # 48 kHz to 16 kHz, less the filter's lag
    families = {f.name: f for f in counter_families(operator_counters(p.graph))}
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value for f in families.values() for s in f.samples
    }
    decoded = samples[("aisp_media_units_total", (("stage", "video"), ("unit", "frames")))]
    assert decoded == len(whole.frames["a"]) + len(whole.frames["b"])
    assert samples[("aisp_media_items_total", (("outcome", "refused"), ("stage", "video")))] == len(dead)
