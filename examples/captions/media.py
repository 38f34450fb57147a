"""Sample live video for the captions example: each stream a camera's MPEG transport stream
(H.264 at 10 frames a second, a key frame every second, AAC sound at 48 kHz), its picture showing
a slide title that changes every few seconds, its sound espeak-ng saying known sentences between
silences; cut into chunks of about ``chunk_ms`` of the stream at random points, as a camera's
encoder sends them.

    python examples/captions/media.py DIR --streams 2   # DIR/cam-00.ts ... and DIR/truth.jsonl
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import numpy as np

from aisp.bench.speech import RATE, conversation
from aisp.bench.video import make_video

FPS = 10
AUDIO_RATE = 48000
SLIDES = ("WELCOME", "AGENDA", "RESULTS", "ROADMAP", "QUESTIONS", "THANK YOU")
SLIDE_S = 4.0


def slide(stream: int, t: float) -> str:
    """The slide title stream ``stream`` shows at ``t`` seconds."""
    return SLIDES[(stream + int(t / SLIDE_S)) % len(SLIDES)]


def camera(stream: int, sentences: int = 3) -> tuple[bytes, dict[str, Any]]:
    """One camera's transport stream and what it shows and says: ``{"slides": [(start_s, title)],
    "speech": [(start_s, end_s, text)]}``."""
    import soxr

    voice, said = conversation(100 + stream, count=sentences)
    seconds = len(voice) / RATE
    frames = int(seconds * FPS)
    sound = soxr.resample(voice, RATE, AUDIO_RATE, quality="HQ").astype(np.float32)
    data = make_video(
        frames,
        width=320,
        height=240,
        fps=FPS,
        gop=FPS,
        bframes=1,
        audio=(sound, AUDIO_RATE),
        text=lambda i: slide(stream, i / FPS),
    )
    shown = [(k * SLIDE_S, slide(stream, k * SLIDE_S)) for k in range(int(seconds / SLIDE_S) + 1)]
    return data, {"slides": shown, "speech": said, "seconds": seconds}


def chunks(data: bytes, seconds: float, chunk_ms: int, seed: int) -> list[bytes]:
    """``data`` cut at random points, about ``chunk_ms`` of the stream apart."""
    rng = np.random.default_rng(seed)
    count = max(1, int(seconds * 1000 / chunk_ms))
    cuts = sorted(set(rng.integers(1, len(data), count - 1).tolist())) if count > 1 else []
    edges = [0, *cuts, len(data)]
    return [data[a:b] for a, b in zip(edges, edges[1:], strict=False) if b > a]


def rows(
    streams: int, sentences: int = 3, chunk_ms: int = 100
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Every stream's chunks as rows ``{"stream", "seq", "video"}``, the streams interleaved in
    stream order (as they would arrive live), and each stream's truth."""
    out: list[tuple[float, dict[str, Any]]] = []
    truth: dict[str, Any] = {}
    for s in range(streams):
        name = f"cam-{s:02d}"
        data, truth[name] = camera(s, sentences)
        parts = chunks(data, truth[name]["seconds"], chunk_ms, seed=s)
        out += [((k + 0.5) / len(parts), {"stream": name, "seq": k, "video": p}) for k, p in enumerate(parts)]
    out.sort(key=lambda item: (item[0], item[1]["stream"]))
    return [r for _, r in out], truth


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("directory", type=Path)
    ap.add_argument("--streams", type=int, default=2)
    ap.add_argument("--sentences", type=int, default=3)
    args = ap.parse_args()
    args.directory.mkdir(parents=True, exist_ok=True)
    truth = {}
    for s in range(args.streams):
        data, truth[f"cam-{s:02d}"] = camera(s, args.sentences)
        (args.directory / f"cam-{s:02d}.ts").write_bytes(data)
    with (args.directory / "truth.jsonl").open("w") as f:
        for name, t in truth.items():
            f.write(json.dumps({"stream": name, **t}) + "\n")
    print(f"wrote {args.streams} streams to {args.directory}")


if __name__ == "__main__":
    main()
