"""Live captions and on-screen text from many camera streams: chunks of video in, what is said and
what is shown out, each with its time in the stream.

    rows {"stream", "seq", "video"}  (chunks of an MPEG transport stream, cut anywhere; base64 in JSON)
      -> key by stream
      -> video (VideoDecode: each stream's demuxer and decoders carried from chunk to chunk; one
         frame a second kept, the sound on the "audio" port; hostile chunks -> dead letters)
         -> prepare (ImagePreprocess of the RGB frames: 256 x 320, BGR, normalised)
         -> read (TextReader: PP-OCRv4 on every stream's frames at once, dynamic batching)
         -> {"stream", "kind": "screen", "start_s", "end_s", "text", "final": true}
      -> audio -> key by stream -> resample (48 kHz to 16 kHz, each stream's filter carried)
         -> vad (SpeechSegments) -> asr (SpeechToText: Whisper tiny.en over every stream's
            segments at once; a partial caption every second of a long one, then the final)
         -> {"stream", "kind": "caption", "start_s", "end_s", "text", "final"}

Run it: ``aisp run examples/captions/pipeline.py --output out.jsonl`` (4 generated cameras of 3
sentences each, see ``media.py``); with ``--checkpoint-dir DIR`` a restart goes on mid-stream
with every stream's demuxer, decoders and pending speech. Serve it: ``aisp serve
examples/captions/pipeline.py --param streams=0`` and send ``{"stream", "seq", "video":
"<base64 chunk>"}`` events over HTTP or a WebSocket.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import msgspec
import numpy as np
import pyarrow as pa

from aisp import BatcherConfig, NullSink, Pipeline, TestingSource
from aisp.batch import META_COLUMNS, Batch
from aisp.infer.runtimes.ocr import TextReader, det_preprocess
from aisp.transform.media.images import ImagePreprocess
from aisp.transform.media.resample import Resample
from aisp.transform.media.speech import SpeechToText
from aisp.transform.media.vad import SpeechSegments
from aisp.transform.media.video import AUDIO_PORT, VideoDecode

HERE = Path(__file__).resolve().parent
OUTPUT_COLUMNS = ["stream", "kind", "start_s", "end_s", "text", "final"]
SIZE = (256, 320)


class Row(msgspec.Struct):
    """One chunk of one camera's transport stream."""

    stream: str
    seq: int
    video: bytes


def _media() -> object:
    spec = importlib.util.spec_from_file_location("aisp_example_captions_media", HERE / "media.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def _rows(batch: Batch, kind: str, start: str, end: str, text: pa.Array, final: pa.Array) -> Batch:
    meta = {c: batch.column(c) for c in META_COLUMNS if c in batch.column_names}
    cols = {
        "stream": batch.column("stream"),
        "kind": pa.array([kind] * batch.num_rows, pa.string()),
        "start_s": batch.column(start),
        "end_s": batch.column(end),
        "text": text,
        "final": final,
    }
    return Batch.from_columns({**cols, **meta})


def screen_rows(batch: Batch) -> Batch:
    """A frame's text regions as one row: what the screen shows at the frame's time."""
    texts = [" ".join(t) for t in batch.pylist("texts")]
    finals = pa.array(np.ones(batch.num_rows, dtype=bool))
    return _rows(batch, "screen", "pts_s", "pts_s", pa.array(texts, pa.string()), finals)


def caption_rows(batch: Batch) -> Batch:
    return _rows(batch, "caption", "start_s", "end_s", batch.column("text"), batch.column("final"))


def build(
    streams: int | str = 4,
    sentences: int | str = 3,
    chunk_ms: int | str = 100,
    partial_every_s: float | str = 1.0,
) -> Pipeline:
    """The captions example over ``streams`` generated cameras (``--param``; 0: none, to serve)."""
    rows = _media().rows(int(streams), int(sentences), int(chunk_ms))[0] if int(streams) else []  # type: ignore[attr-defined]
    p = Pipeline("captions", output_columns=OUTPUT_COLUMNS)
    source = p.source("chunks", TestingSource(rows, batch_rows=16), schema=Row)
    keyed = source.key_by("by_stream", "stream")
    video = keyed.apply("video", VideoDecode(stream="stream", fps=1, audio=True), latency_budget_ms=20.0)
    prepared = video.apply(
        "prepare",
        ImagePreprocess(column="frame", input="rgb24", size=SIZE, **det_preprocess()),
        latency_budget_ms=20.0,
    )
    reader = TextReader(SIZE)
    read = prepared.infer(
        "read",
        reader,
        inputs={"image": "pixels"},
        outputs={n: n for n in reader.output_names},
        batcher=BatcherConfig(max_batch_size=8, max_queue_delay_ms=10.0),
        latency_budget_ms=500.0,
    )
    screen = read.map_batch("screen", screen_rows)
    sound = video.output(AUDIO_PORT).key_by("by_stream_audio", "stream")
    samples = sound.apply("resample", Resample(input_rate=48000, sample_rate=16000), latency_budget_ms=10.0)
    segments = samples.apply("vad", SpeechSegments(), latency_budget_ms=20.0)
    said = segments.apply(
        "asr", SpeechToText(partial_every_s=float(partial_every_s)), latency_budget_ms=1500.0
    )
    captions = said.map_batch("captions", caption_rows)
    p.union("out_rows", screen, captions).sink("out", NullSink())
    return p
