"""The audio example (`examples/audio/`): many interleaved streams of 100 ms chunks give each
stream the speech segments it holds and the MFCC of the whole stream, chunk boundaries or not;
bad chunks are dead letters; the pipeline is served over HTTP with base64 PCM in JSON."""

from __future__ import annotations

import base64
import json

import httpx
import numpy as np

from aisp import CollectSink
from aisp.transform.media.audio import AudioFeatures
from benchmarks.workload import load_example
from tests.support.serving import aisp_serve, wait_http
from tests.unit.transform.media.test_audio import Features

VOICES = load_example("audio/voices.py", "aisp_example_audio_voices")
EXAMPLE = load_example("audio/pipeline.py", "aisp_example_audio_pipeline")
COLUMNS = ["stream", "seq", "speech_start", "speech_end", "speaking", "first_frame", "n_frames", "mfcc"]


def run_example(streams: int, chunk_ms: int) -> dict[str, list[dict[str, object]]]:
    p = EXAMPLE.build(streams=streams, seconds=8.0, chunk_ms=chunk_ms)
    out = CollectSink(columns=COLUMNS)
    p.bind(sink=out)
    p.run()
    by_stream: dict[str, list[dict[str, object]]] = {}
    for row in out.rows:
        by_stream.setdefault(str(row["stream"]), []).append(row)
    return by_stream


def agreement(found: list[tuple[float, float]], truth: list[tuple[float, float]], seconds: float) -> float:
    """The share of 10 ms steps on which the segments found and the true ones agree."""
    t = np.arange(0, seconds, 0.01)

    def mask(spans: list[tuple[float, float]]) -> np.ndarray:
        return np.any([(t >= a) & (t < b) for a, b in spans], axis=0) if spans else np.zeros_like(t, bool)

    return float((mask(found) == mask(truth)).mean())


def test_each_stream_gets_its_speech_segments_and_its_whole_mfcc() -> None:
    streams = 6
    rows = run_example(streams, chunk_ms=100)
    assert sorted(rows) == [f"caller-{s:03d}" for s in range(streams)]
    whole = Features(AudioFeatures(space="s"))
    for s in range(streams):
        mine = sorted(rows[f"caller-{s:03d}"], key=lambda r: r["seq"])
        assert [r["seq"] for r in mine] == list(range(80))
        found = [(a, b) for r in mine for a, b in zip(r["speech_start"], r["speech_end"], strict=True)]  # type: ignore[call-overload]
        y, truth = VOICES.stream(s, 8.0)
        assert len(found) >= len(truth) - 1
        assert agreement(found, truth, 8.0) >= 0.85, (found, truth)
        # the MFCC of the chunks, in order, are those of the whole stream (as 16-bit PCM)
        pcm = (np.clip(y, -1, 1) * 32767).astype("<i2").astype(np.float32) / 32768.0
        want = np.asarray(whole.feed([(f"w{s}", pcm)]).pylist("mfcc")[0]).reshape(-1, 13)
        got = np.concatenate([np.asarray(r["mfcc"]).reshape(-1, 13) for r in mine])
        assert [r["first_frame"] for r in mine] == list(np.cumsum([0] + [r["n_frames"] for r in mine[:-1]]))
        np.testing.assert_allclose(got, want, atol=1e-4)


def test_served_pipeline_answers_base64_pcm_chunks_over_http() -> None:
    with aisp_serve(EXAMPLE.__file__, http=True, grpc=False, extra_args=("--param", "streams=0")) as (
        addr,
        _,
    ):
        wait_http(addr["http"], timeout_s=120)
        chunks = VOICES.chunks(2, 2.0, 100)
        events = [{**c, "audio": base64.b64encode(c["audio"]).decode()} for c in chunks]
        events.append({"stream": "bad", "seq": 0, "audio": base64.b64encode(b"\x01\x02\x03").decode()})
        body = "\n".join(json.dumps(e) for e in events)
        r = httpx.post(f"http://{addr['http']}/v1/pipelines/audio/events", content=body, timeout=120)
        assert r.status_code == 200, r.text
        answers = [json.loads(x) for x in r.content.splitlines()]
        done = [a for a in answers if "n_frames" in a]
        assert len(done) == len(chunks) and sum(a["n_frames"] for a in done) == 2 * (1 + (32000 - 400) // 160)
        assert any("whole number of samples" in json.dumps(a) for a in answers), answers[-1]
