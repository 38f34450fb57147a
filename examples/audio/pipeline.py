"""Speech in many concurrent audio streams: chunks in, speech segments and MFCC features out.

    rows {"stream", "seq", "audio"}  (16-bit PCM at 16 kHz, 100 ms a chunk; base64 in JSON)
      -> decode (AudioDecode: samples; a chunk that is not whole samples -> dead letter)
      -> key by stream
      -> features (AudioFeatures: log-mel and MFCC, 25 ms frames every 10 ms, with each stream's
         running normalisation; the samples a chunk leaves over carry to its stream's next one)
      -> vad (SpeechSegments: Silero VAD across all streams at once, its recurrent state per stream)
      -> {"stream", "seq", "speech_start", "speech_end", "speaking", "first_frame", "n_frames", "mfcc"}

Run it: ``aisp run examples/audio/pipeline.py --output out.jsonl`` (16 generated callers, 8 s each,
see ``voices.py``); with ``--checkpoint-dir DIR`` a restart goes on mid-stream with every stream's
state. Serve it: ``aisp serve examples/audio/pipeline.py`` and send ``{"stream", "seq", "audio":
"<base64 PCM>"}`` events, over HTTP or a WebSocket.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import msgspec

from aisp import NullSink, Pipeline, TestingSource
from aisp.transform.media.audio import AudioDecode, AudioFeatures
from aisp.transform.media.vad import SpeechSegments

HERE = Path(__file__).resolve().parent
OUTPUT_COLUMNS = [
    "stream",
    "seq",
    "speech_start",
    "speech_end",
    "speaking",
    "first_frame",
    "n_frames",
    "mfcc",
]


class Row(msgspec.Struct):
    """One chunk of one stream's audio."""

    stream: str
    seq: int
    audio: bytes


def _voices() -> object:
    spec = importlib.util.spec_from_file_location("aisp_example_audio_voices", HERE / "voices.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def build(streams: int | str = 16, seconds: float | str = 8.0, chunk_ms: int | str = 100) -> Pipeline:
    """The audio example over ``streams`` generated callers (``--param``)."""
    rows = _voices().chunks(int(streams), float(seconds), int(chunk_ms))  # type: ignore[attr-defined]
    p = Pipeline("audio", output_columns=OUTPUT_COLUMNS)
    source = p.source("chunks", TestingSource(rows, batch_rows=64), schema=Row)
    samples = source.apply("decode", AudioDecode(format="pcm_s16le", input_rate=16000), latency_budget_ms=5.0)
    keyed = samples.key_by("by_stream", "stream")
    features = keyed.apply("features", AudioFeatures(), latency_budget_ms=10.0)
    features.apply("vad", SpeechSegments(), latency_budget_ms=20.0).sink("out", NullSink())
    return p
