"""Video through AISP against the PyAV loop a user writes: frames decoded, and frames read by OCR.

The workload: ``--streams`` cameras of ``--seconds`` each (``aisp.bench.video.make_video``:
H.264 in MPEG-TS, ``--width`` x ``--height`` at 25 frames a second, a key frame a second, a slide
title on screen that changes every 4 s). Each contender decodes every frame of every stream and
reads the text of ``--fps`` frames a second with PP-OCRv4 (``TextReader``, 256 x 320 letterboxed):

* ``loop``: what a user writes with PyAV: stream by stream, ``av.open`` on the whole file with
  FFmpeg's own decoding threads (``thread_type="AUTO"``), every frame decoded, the first frame at
  or after each ``1 / fps`` s converted to BGR, letterboxed and normalised with OpenCV and numpy,
  one ``TextReader`` call a frame with an intra-op thread per core;
* ``aisp``: the streams as live chunks of about 100 ms (cut at random points), interleaved:
  key by stream -> ``VideoDecode(stream=..., fps=...)`` (each stream's demuxer and decoder
  carried from chunk to chunk, streams on one thread per core) -> ``ImagePreprocess`` of the
  RGB frames -> an ``infer`` step with dynamic batching (up to 8 frames a call).

Reported per contender (median of ``--rounds`` rounds, contenders alternating): wall seconds,
frames decoded a second, frames read a second, and the share of read frames whose text is the
slide shown (the same model: both should read the same).

    python benchmarks/bench_video.py [--streams 8 --seconds 20 --fps 2 --rounds 3]
"""

from __future__ import annotations

import argparse
import io
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from aisp.bench.video import chunks, make_video  # noqa: E402
from aisp.transform.media.common import cores  # noqa: E402

FPS = 25
SIZE = (256, 320)
SLIDES = ("WELCOME", "AGENDA", "RESULTS", "ROADMAP", "QUESTIONS", "THANK YOU")


def slide(stream: int, t: float) -> str:
    return SLIDES[(stream + int(t / 4.0)) % len(SLIDES)]


def cameras(streams: int, seconds: float, width: int, height: int) -> list[bytes]:
    return [
        make_video(
            int(seconds * FPS), width=width, height=height, fps=FPS, gop=FPS, bframes=2,
            text=lambda i, s=s: slide(s, i / FPS),
        )
        for s in range(streams)
    ]  # fmt: skip


def loop(videos: list[bytes], fps: float) -> dict[str, Any]:
    """The PyAV loop (see the module docstring)."""
    import av
    import cv2

    from aisp.infer.runtimes.ocr import TextReader, det_preprocess

    reader = TextReader(SIZE, threads=cores())
    prep = det_preprocess()
    mean, std = np.array(prep["mean"], np.float32), np.array(prep["std"], np.float32)
    h, w = SIZE
    decoded = read = right = 0
    t0 = time.perf_counter()
    for s, data in enumerate(videos):
        with av.open(io.BytesIO(data)) as container:
            stream = container.streams.video[0]
            stream.thread_type = "AUTO"
            next_at, start = 0.0, None
            for frame in container.decode(stream):
                decoded += 1
                t = float(frame.time)
                start = t if start is None else start
                if t - start + 1e-9 < next_at:
                    continue
                next_at += 1.0 / fps * (int((t - start - next_at) * fps + 1e-9) + 1)
                bgr = frame.to_ndarray(format="bgr24")
                scale = min(h / bgr.shape[0], w / bgr.shape[1])
                nh, nw = round(bgr.shape[0] * scale), round(bgr.shape[1] * scale)
                canvas = np.zeros((h, w, 3), np.uint8)
                y0, x0 = (h - nh) // 2, (w - nw) // 2
                canvas[y0 : y0 + nh, x0 : x0 + nw] = cv2.resize(bgr, (nw, nh), interpolation=cv2.INTER_AREA)
                tensor = ((canvas.astype(np.float32) / 255.0 - mean) / std).transpose(2, 0, 1)
                out = reader.run({"image": tensor.reshape(1, -1)})
                read += 1
                right += " ".join(out["texts"][0]) == slide(s, t - start)
    seconds = time.perf_counter() - t0
    return {"seconds": seconds, "decoded_per_s": decoded / seconds, "read_per_s": read / seconds,
            "read": read, "right": right / max(read, 1)}  # fmt: skip


def through_aisp(videos: list[bytes], seconds: float, fps: float, seed: int) -> dict[str, Any]:
    """The pipeline (see the module docstring)."""
    from aisp import BatcherConfig, CollectSink, Pipeline, TestingSource
    from aisp.infer.runtimes.ocr import TextReader, det_preprocess
    from aisp.observe.export.operators import operator_counters
    from aisp.transform.media.images import ImagePreprocess
    from aisp.transform.media.video import VideoDecode

    rng = np.random.default_rng(seed)
    pieces: list[tuple[float, dict[str, Any]]] = []
    for s, data in enumerate(videos):
        count = max(2, int(seconds * 10))  # about 100 ms of the stream a chunk
        cuts = sorted(set(rng.integers(1, len(data), count - 1).tolist()))
        parts = chunks(data, cuts)
        pieces += [
            ((k + 0.5) / len(parts), {"stream": f"cam-{s}", "seq": k, "video": p})
            for k, p in enumerate(parts)
        ]
    pieces.sort(key=lambda x: x[0])
    rows = [r for _, r in pieces]
    p = Pipeline("video")
    out = CollectSink(columns=["stream", "pts_s", "texts"])
    keyed = p.source("chunks", TestingSource(rows, batch_rows=32)).key_by("by_stream", "stream")
    video = keyed.apply("video", VideoDecode(stream="stream", fps=fps))
    prepared = video.apply(
        "prepare", ImagePreprocess(column="frame", input="rgb24", size=SIZE, **det_preprocess())
    )
    reader = TextReader(SIZE)
    prepared.infer(
        "read", reader, inputs={"image": "pixels"}, outputs={"texts": "texts"},
        batcher=BatcherConfig(max_batch_size=8, max_queue_delay_ms=5.0),
    ).sink("out", out)  # fmt: skip
    t0 = time.perf_counter()
    p.run()
    took = time.perf_counter() - t0
    decoded = operator_counters(p.graph)["media"]["video"]["units"]
    right = sum(" ".join(r["texts"]) == slide(int(r["stream"][4:]), r["pts_s"]) for r in out.rows)
    return {"seconds": took, "decoded_per_s": decoded / took, "read_per_s": len(out.rows) / took,
            "read": len(out.rows), "right": right / max(len(out.rows), 1)}  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--streams", type=int, default=8)
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--fps", type=float, default=2.0)
    ap.add_argument("--width", type=int, default=640)
    ap.add_argument("--height", type=int, default=360)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    videos = cameras(args.streams, args.seconds, args.width, args.height)
    runs: dict[str, list[dict[str, Any]]] = {"loop": [], "aisp": []}
    for r in range(args.rounds):
        for name in ("loop", "aisp") if r % 2 == 0 else ("aisp", "loop"):
            got = (
                loop(videos, args.fps)
                if name == "loop"
                else through_aisp(videos, args.seconds, args.fps, seed=r)
            )
            runs[name].append(got)
            print(
                json.dumps({"round": r, "contender": name, **{k: round(v, 3) for k, v in got.items()}}),
                flush=True,
            )
    med = {name: {k: statistics.median(x[k] for x in rs) for k in rs[0]} for name, rs in runs.items()}
    report = {
        "streams": args.streams, "seconds": args.seconds, "fps": args.fps, "size": [args.width, args.height],
        "median": med,
        "ratio_wall": med["loop"]["seconds"] / med["aisp"]["seconds"],
        "ratio_decoded": med["aisp"]["decoded_per_s"] / med["loop"]["decoded_per_s"],
    }  # fmt: skip
    print(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
