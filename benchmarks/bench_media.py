"""Images and audio through AISP against hand-written loops, in one run.

**Images** (``--images`` JPEG files of 640x480 to 1600x1200 on disk, written once): decode,
resize to the model's input keeping the aspect ratio (letterbox), normalise, run the model. The
model (``--model``): ``cls``, PP-OCR's text direction classifier (3 x 48 x 192, light: decoding
dominates), or ``det``, PP-OCRv4's text detector (3 x 320 x 640, heavy: the model dominates).

* ``pillow``: a loop over the files that does what a user writes first: Pillow opens and
  decodes each, resizes it (bilinear), numpy normalises it, one ONNX Runtime call per image
  with ``--threads`` intra-op threads (every core by default);
* ``pillow_draft``: the same loop with ``Image.draft``, which lets libjpeg decode at a DCT scale
  (1/2, 1/4, 1/8) no smaller than the target: the strongest plain loop;
* ``aisp``: ``FilesSource`` -> ``ImagePreprocess`` (decoding on one thread per core) ->
  an ``infer`` step with dynamic batching (the model's intra-op threads: ``--aisp-threads``).

Each round runs the three in turn (alternating); the report gives images/s and the p99 of each
image's latency (a loop: the time of its iteration; AISP: read to result, queueing included),
the median of ``--rounds`` rounds and the ratios of the medians.

**Audio** (``--streams``, a list): that many concurrent callers, each sending 100 ms chunks of
16-bit PCM at real time (the source paced at streams x 10 chunks/s) through the audio example's
pipeline (decode, MFCC with carry-over, Silero VAD across streams); the report gives the chunks'
p99 latency and whether the pipeline kept up (chunks/s against the rate).

**Libraries**, measured in the same run: each JPEG decoder's images/s on one thread and on two
(whether it releases the GIL), and the MFCC of ``AudioFeatures`` (100 ms chunks of 16 streams)
against librosa's on the whole streams, in seconds of audio per second.

    python benchmarks/bench_media.py [--images 240 --model cls --rounds 3 --streams 64,128,256]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort

MODELS = {
    "cls": ("ch_ppocr_mobile_v2.0_cls_infer.onnx", (48, 192)),
    "det": ("ch_PP-OCRv4_det_infer.onnx", (320, 640)),
}
MEAN = np.array([0.485, 0.456, 0.406], dtype=np.float32)
STD = np.array([0.229, 0.224, 0.225], dtype=np.float32)


def model_path(name: str) -> Path:
    from aisp.infer.runtimes.ocr import packaged_ppocr

    return packaged_ppocr()[0].parent / MODELS[name][0]


def write_photos(directory: Path, count: int) -> list[Path]:
    """``count`` photo-like JPEGs (gradients, shapes, noise) of several sizes, quality 90."""
    import cv2

    sizes = [(480, 640), (720, 960), (768, 1024), (1200, 1600)]
    paths = []
    for i in range(count):
        rng = np.random.default_rng(i)
        h, w = sizes[i % len(sizes)]
        y, x = np.mgrid[0:h, 0:w].astype(np.float32)
        img = np.stack([x / w * 200, y / h * 200, (x + y) / (w + h) * 255], axis=2)
        for _ in range(12):
            cx, cy, r = int(rng.integers(0, w)), int(rng.integers(0, h)), int(rng.integers(10, h // 3))
            color = tuple(int(c) for c in rng.integers(0, 255, 3))
            cv2.circle(img, (cx, cy), r, color, -1)
        img = np.clip(img + rng.normal(0, 6, img.shape), 0, 255).astype(np.uint8)
        path = directory / f"photo-{i:04d}.jpg"
        cv2.imwrite(str(path), img, [cv2.IMWRITE_JPEG_QUALITY, 90])
        paths.append(path)
    return paths


class PillowLoop:
    """The hand-written loop (see the module docstring)."""

    def __init__(self, model: Path, size: tuple[int, int], threads: int, draft: bool) -> None:
        opts = ort.SessionOptions()
        opts.intra_op_num_threads = threads
        self.session = ort.InferenceSession(str(model), sess_options=opts, providers=["CPUExecutionProvider"])
        self.input = self.session.get_inputs()[0].name
        self.size, self.draft = size, draft

    def one(self, path: Path) -> Any:
        from PIL import Image

        h, w = self.size
        with Image.open(path) as img:
            if self.draft:
                img.draft("RGB", (w, h))  # libjpeg's DCT scaling, no smaller than the target
            img = img.convert("RGB")
            s = min(h / img.height, w / img.width)
            nw, nh = max(1, round(img.width * s)), max(1, round(img.height * s))
            resized = img.resize((nw, nh), Image.Resampling.BILINEAR)
        canvas = np.zeros((h, w, 3), dtype=np.float32)
        y0, x0 = (h - nh) // 2, (w - nw) // 2
        canvas[y0 : y0 + nh, x0 : x0 + nw] = np.asarray(resized, dtype=np.float32)
        tensor = ((canvas / 255.0 - MEAN) / STD).transpose(2, 0, 1)[None]
        return self.session.run(None, {self.input: np.ascontiguousarray(tensor)})

    def run(self, paths: list[Path]) -> dict[str, float]:
        took = []
        t0 = time.perf_counter()
        for path in paths:
            t = time.perf_counter()
            self.one(path)
            took.append(time.perf_counter() - t)
        seconds = time.perf_counter() - t0
        return {"per_s": len(paths) / seconds, "p99_ms": float(np.percentile(took, 99)) * 1000}


def through_aisp(directory: Path, model: str, threads: int, batch: int) -> dict[str, float]:
    from aisp import BatcherConfig, FilesSource, NullSink, OnnxRuntime, Pipeline
    from aisp.infer.runtimes.base import Reshaped
    from aisp.transform.media.images import ImagePreprocess

    size = MODELS[model][1]
    p = Pipeline("images")
    prep = ImagePreprocess(column="data", size=size, mean=tuple(MEAN.tolist()), std=tuple(STD.tolist()))
    runtime = OnnxRuntime(model_path(model), name=model, intra_op_threads=threads)
    shaped = Reshaped(runtime, {runtime.input_names[0]: (3, *size)})
    tensors = p.source("files", FilesSource(directory, pattern="*.jpg", batch_rows=8)).apply("prepare", prep)
    tensors.infer(
        "model",
        shaped,
        inputs={runtime.input_names[0]: "pixels"},
        outputs={runtime.output_names[0]: "out"},
        batcher=BatcherConfig(max_batch_size=batch, max_queue_delay_ms=5.0),
    ).sink("out", NullSink())
    t0 = time.perf_counter()
    summary = p.run()
    seconds = time.perf_counter() - t0
    assert summary.events_out == len(list(directory.glob("*.jpg"))), summary
    return {
        "per_s": summary.events_out / seconds,
        "p99_ms": summary.latency_ms["p99"],
        "mean_batch": summary.models["model"].get("mean_batch_rows", 0.0),
    }


BUCKETS = {"landscape": (480, 640), "portrait": (640, 480), "wide": (320, 640)}
"""Shape buckets of the ``--buckets`` measurement; padding puts every image in ``PADDED``."""
PADDED = (640, 640)


def mixed_photos(directory: Path, count: int) -> None:
    """``count`` JPEGs of three shapes (4:3, 3:4, 2:1) for the bucketing measurement."""
    import cv2

    shapes = [(720, 960), (960, 720), (640, 1280)]
    for i in range(count):
        h, w = shapes[i % 3]
        rng = np.random.default_rng(i)
        img = np.clip(rng.normal(128, 40, (h // 8, w // 8, 3)), 0, 255).astype(np.uint8)
        img = cv2.resize(img, (w, h), interpolation=cv2.INTER_CUBIC)
        cv2.imwrite(str(directory / f"mixed-{i:04d}.jpg"), img, [cv2.IMWRITE_JPEG_QUALITY, 90])


def bucketed(directory: Path, threads: int, buckets: bool) -> dict[str, float]:
    """The text detector over mixed shapes through AISP: every image letterboxed into one square
    shape (``PADDED``), or routed by aspect ratio (``ImageBuckets``) to one image step and one
    model step per bucket (``BUCKETS``), each batching images of its own shape."""
    from aisp import BatcherConfig, FilesSource, NullSink, OnnxRuntime, Pipeline
    from aisp.infer.runtimes.base import Reshaped
    from aisp.transform.media.images import ImageBuckets, ImagePreprocess

    p = Pipeline("buckets")
    src = p.source("files", FilesSource(directory, pattern="mixed-*.jpg", batch_rows=8))
    sizes = BUCKETS if buckets else {"square": PADDED}
    routes = src.map_batch("bucket", ImageBuckets(sizes, column="data")).route(
        "by_shape", list(sizes), column="bucket"
    )
    ends = []
    for name, size in sizes.items():
        runtime = OnnxRuntime(model_path("det"), name=f"det-{name}", intra_op_threads=threads)
        x = runtime.input_names[0]
        prep = ImagePreprocess(column="data", size=size, mean=tuple(MEAN.tolist()), std=tuple(STD.tolist()))
        ends.append(
            routes[name]
            .apply(f"prepare.{name}", prep)
            .infer(
                f"model.{name}",
                Reshaped(runtime, {x: (3, *size)}),
                inputs={x: "pixels"},
                outputs={runtime.output_names[0]: "mask"},
                batcher=BatcherConfig(max_batch_size=8, max_queue_delay_ms=5.0),
            )
            .map_batch(f"drop.{name}", lambda b: b.drop(["mask", "pixels"]))
        )
    (p.union("all", *ends) if len(ends) > 1 else ends[0]).sink("out", NullSink())
    t0 = time.perf_counter()
    summary = p.run()
    seconds = time.perf_counter() - t0
    return {"per_s": summary.events_out / seconds, "p99_ms": summary.latency_ms["p99"]}


def decoders(paths: list[Path], size: tuple[int, int]) -> dict[str, Any]:
    """Each JPEG decoder's images/s over ``paths`` on one thread and on two (a library that
    holds the GIL gains nothing from the second): Pillow, Pillow with ``draft``, OpenCV,
    OpenCV at a reduced scale, simplejpeg, simplejpeg at a DCT scale covering ``size``."""
    from concurrent.futures import ThreadPoolExecutor

    import cv2
    import simplejpeg
    from PIL import Image

    blobs = [p.read_bytes() for p in paths]
    h, w = size

    def pillow(data: bytes, draft: bool = False) -> Any:
        import io

        with Image.open(io.BytesIO(data)) as img:
            if draft:
                img.draft("RGB", (w, h))
            return np.asarray(img.convert("RGB"))

    fns = {
        "pillow": pillow,
        "pillow_draft": lambda d: pillow(d, True),
        "opencv": lambda d: cv2.imdecode(np.frombuffer(d, np.uint8), cv2.IMREAD_COLOR),
        "opencv_reduced_4": lambda d: cv2.imdecode(np.frombuffer(d, np.uint8), cv2.IMREAD_REDUCED_COLOR_4),
        "simplejpeg": lambda d: simplejpeg.decode_jpeg(d),
        "simplejpeg_scaled": lambda d: simplejpeg.decode_jpeg(d, min_height=h, min_width=w),
    }
    cv2.setNumThreads(1)
    out = {}
    for name, fn in fns.items():
        rates = []
        for threads in (1, 2):
            with ThreadPoolExecutor(threads) as pool:
                t0 = time.perf_counter()
                list(pool.map(fn, blobs))
                rates.append(len(blobs) / (time.perf_counter() - t0))
        out[name] = {"one_thread": round(rates[0], 1), "two_threads": round(rates[1], 1),
                     "scaling": round(rates[1] / rates[0], 2)}  # fmt: skip
    return out


def features(seconds: float = 60.0) -> dict[str, float]:
    """Seconds of audio per second of work: ``AudioFeatures`` on 100 ms chunks of 16 streams
    against librosa's MFCC (``center=False``, the same frames) on each whole stream, and on each
    chunk after its stream's unused tail (the loop a user writes for streams)."""
    import librosa
    import pyarrow as pa

    from aisp.batch import KEY, Batch
    from aisp.state.keyed import KeyIndex
    from aisp.transform.media.audio import AudioFeatures
    from aisp.transform.operators import OperatorContext

    rng = np.random.default_rng(0)
    streams = [rng.standard_normal(int(seconds * 16000 / 16)).astype(np.float32) * 0.1 for _ in range(16)]
    librosa.feature.mfcc(
        y=streams[0][:16000], sr=16000, n_mfcc=13, n_fft=400, hop_length=160, n_mels=40, center=False
    )
    t0 = time.perf_counter()  # (after a first call: librosa compiles and caches on first use)
    for y in streams:
        librosa.feature.mfcc(y=y, sr=16000, n_mfcc=13, n_fft=400, hop_length=160, n_mels=40, center=False)
    ref = seconds / (time.perf_counter() - t0)
    chunk = 1600
    t0 = time.perf_counter()  # the loop a user writes for streams: each chunk after its stream's tail
    tails = [np.zeros(0, dtype=np.float32) for _ in streams]
    for start in range(0, len(streams[0]), chunk):
        for i, y in enumerate(streams):
            buf = np.concatenate([tails[i], y[start : start + chunk]])
            frames = 0 if len(buf) < 400 else 1 + (len(buf) - 400) // 160
            if frames:
                librosa.feature.mfcc(
                    y=buf, sr=16000, n_mfcc=13, n_fft=400, hop_length=160, n_mels=40, center=False
                )
            tails[i] = buf[frames * 160 :]
    per_chunk = seconds / (time.perf_counter() - t0)
    index = KeyIndex()
    op: Any = AudioFeatures(space="s").build(OperatorContext("f", lambda *a, **k: None, {"s": index}))
    t0 = time.perf_counter()
    for start in range(0, len(streams[0]), chunk):
        names = pa.array([f"s{i}" for i in range(len(streams))])
        samples = pa.array([y[start : start + chunk] for y in streams], pa.list_(pa.float32()))
        batch = Batch.from_columns({"stream": names, "samples": samples})
        op.process(batch.with_columns({KEY: index.encode(names)}))
    ours = seconds / (time.perf_counter() - t0)
    return {
        "librosa_whole_streams": round(ref, 1),
        "librosa_100ms_chunks": round(per_chunk, 1),
        "aisp_100ms_chunks": round(ours, 1),
    }


def audio(streams: int, seconds: float) -> dict[str, Any]:
    from aisp import RunOptions
    from aisp.schedule.config import ExecutorOptions

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from benchmarks.workload import load_example

    example = load_example("audio/pipeline.py", "aisp_example_audio_pipeline")
    p = example.build(streams=streams, seconds=seconds, chunk_ms=100)
    rate = streams * 10.0
    t0 = time.perf_counter()
    summary = p.run(RunOptions(execution=ExecutorOptions(rate_events_per_s=rate)))
    wall = time.perf_counter() - t0
    return {
        "streams": streams,
        "chunks": summary.events_out,
        "rate_chunks_per_s": rate,
        "chunks_per_s": round(summary.events_out / wall, 1),
        "kept_up": summary.events_out / wall >= 0.95 * rate,
        "p50_ms": summary.latency_ms["p50"],
        "p99_ms": summary.latency_ms["p99"],
        "dead_letters": summary.dead_letters,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--images", type=int, default=240)
    ap.add_argument("--model", choices=sorted(MODELS), default="cls")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=0, help="the loops' intra-op threads (0: every core)")
    ap.add_argument("--aisp-threads", type=int, default=1)
    ap.add_argument("--batch", type=int, default=0, help="AISP's largest batch (0: 32 for cls, 8 for det)")
    ap.add_argument("--streams", default="64,128,256", help="audio: concurrent streams to try ('' skips)")
    ap.add_argument("--seconds", type=float, default=10.0, help="audio: seconds per stream")
    ap.add_argument(
        "--buckets", type=int, default=0, help="images of mixed shapes for the bucketing measurement"
    )
    args = ap.parse_args()
    report: dict[str, Any] = {"images": args.images, "model": args.model, "rounds": args.rounds}
    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(tmp)
        paths = write_photos(directory, args.images)
        report["megapixels"] = round(sum(h * w for h, w in _sizes(paths)) / len(paths) / 1e6, 2)
        report["decoders_images_per_s"] = decoders(paths, MODELS[args.model][1])
        loops = {
            name: PillowLoop(model_path(args.model), MODELS[args.model][1], args.threads, draft)
            for name, draft in (("pillow", False), ("pillow_draft", True))
        }
        for loop in loops.values():
            loop.run(paths[:4])  # warm-up
        runs: dict[str, list[dict[str, float]]] = {"pillow": [], "pillow_draft": [], "aisp": []}
        for _ in range(args.rounds):
            for name, loop in loops.items():
                runs[name].append(loop.run(paths))
            batch = args.batch or (32 if args.model == "cls" else 8)
            runs["aisp"].append(through_aisp(directory, args.model, args.aisp_threads, batch))
    med = {k: statistics.median(r["per_s"] for r in v) for k, v in runs.items()}
    p99 = {k: statistics.median(r["p99_ms"] for r in v) for k, v in runs.items()}
    report.update(
        runs={k: [{m: round(x, 2) for m, x in r.items()} for r in v] for k, v in runs.items()},
        median_images_per_s={k: round(v, 1) for k, v in med.items()},
        median_p99_ms={k: round(v, 1) for k, v in p99.items()},
        aisp_vs_pillow=round(med["aisp"] / med["pillow"], 2),
        aisp_vs_pillow_draft=round(med["aisp"] / med["pillow_draft"], 2),
    )
    if args.buckets:
        with tempfile.TemporaryDirectory() as tmp:
            mixed_photos(Path(tmp), args.buckets)
            shaped: dict[str, list[dict[str, float]]] = {"padded": [], "bucketed": []}
            for _ in range(args.rounds):
                shaped["padded"].append(bucketed(Path(tmp), args.aisp_threads, False))
                shaped["bucketed"].append(bucketed(Path(tmp), args.aisp_threads, True))
        report["buckets"] = {
            k: [{m: round(x, 2) for m, x in r.items()} for r in v] for k, v in shaped.items()
        }
        padded, buckets = (statistics.median(r["per_s"] for r in shaped[k]) for k in ("padded", "bucketed"))
        report["bucketed_vs_padded"] = round(buckets / padded, 2)
    report["features_audio_seconds_per_s"] = features()
    if args.streams:
        report["audio"] = [audio(int(n), args.seconds) for n in args.streams.split(",")]
    print(json.dumps(report, indent=1))
    return 0


def _sizes(paths: list[Path]) -> list[tuple[int, int]]:
    from PIL import Image

    out = []
    for path in paths:
        with Image.open(path) as img:
            out.append((img.height, img.width))
    return out


if __name__ == "__main__":
    raise SystemExit(main())
