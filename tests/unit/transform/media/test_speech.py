"""Speech to text: Whisper tiny.en on espeak-ng speech, segments of many streams batched, each
stream's state carried from chunk to chunk, so any cut of the streams, in any batches, and a
restore from a checkpoint give the whole streams' final captions; as accurate as the model alone."""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import pyarrow as pa
import pytest

from aisp.batch import ID, KEY, Batch
from aisp.bench.speech import RATE, conversation, word_error_rate
from aisp.errors import ConfigError
from aisp.state.keyed import KeyIndex
from aisp.transform.media.speech import SpeechToText, packaged_whisper
from aisp.transform.media.vad import SpeechSegments
from aisp.transform.operators import OperatorContext

Caption = tuple[str, float, float, str, bool]


class Captions:
    """SpeechSegments then SpeechToText, as a keyed pipeline runs them, fed rows of samples."""

    def __init__(self, partial_every_s: float = 0.0, **options: Any) -> None:
        self.index = KeyIndex()
        self.dead: list[tuple[int, str]] = []

        def dead_letter(batch: Batch, step: str, reason: str, fields: Any = None) -> None:
            self.dead += [(i, reason) for i in batch.pylist(ID)]

        ctx = OperatorContext("asr", dead_letter, {"s": self.index})
        self.vad: Any = SpeechSegments(space="s").build(ctx)
        self.spec = SpeechToText(partial_every_s=partial_every_s, **options)
        self.asr: Any = self.spec.build(ctx)
        self.captions: list[Caption] = []

    def feed(
        self, rows: list[tuple[str | None, np.ndarray | None]], first_id: int = 0, age_s: float = 0.0
    ) -> None:
        """``rows`` as one batch, ingested ``age_s`` ago."""
        streams = pa.array([s for s, _ in rows], pa.string())
        samples = pa.array([None if c is None else c.tolist() for _, c in rows], pa.list_(pa.float32()))
        batch = Batch.from_columns(
            {"stream": streams, "samples": samples},
            ids=np.arange(first_id, first_id + len(rows)),
            ingest_ns=time.monotonic_ns() - int(age_s * 1e9),
        )
        if self.spec.segments == "vad":
            [(_, batch)] = self.vad.process(batch.with_columns({KEY: self.index.encode(streams)}))
        self._take(self.asr.process(batch))

    def end(self) -> None:
        self._take(self.asr.flush())

    def _take(self, emitted: list[tuple[str, Batch]]) -> None:
        for _, out in emitted:
            cols = [out.pylist(c) for c in ("stream", "start_s", "end_s", "text", "final")]
            self.captions += list(zip(*cols, strict=True))

    def finals(self, stream: str | None = None) -> list[Caption]:
        return [c for c in self.captions if c[4] and (stream is None or c[0] == stream)]


@pytest.fixture(scope="module")
def voices() -> dict[str, tuple[np.ndarray, list[tuple[float, float, str]]]]:
    packaged_whisper()  # the model package is installed (make installs it)
    return {f"s{i}": conversation(i, count=3) for i in range(3)}


def _chunked(
    ys: dict[str, np.ndarray], rng: np.random.Generator, chunk_ms: float
) -> list[tuple[str, np.ndarray]]:
    """Each stream cut at random points about ``chunk_ms`` apart, the streams interleaved."""
    pieces = []
    for name, y in ys.items():
        n = max(1, int(len(y) / (chunk_ms * RATE / 1000)))
        cuts = np.sort(rng.integers(0, len(y), n))
        pieces += [(k, name, c) for k, c in enumerate(np.split(y, cuts))]
    pieces.sort(key=lambda p: p[0])
    return [(name, c) for _, name, c in pieces]


def test_captions_are_as_accurate_as_the_model_alone(voices: dict[str, Any]) -> None:
    """The bound is measured, not set: faster-whisper (the same model and engine, the same
    greedy decoding: no sampled retries, so the bound is the same every run) transcribing each
    whole stream in one call, against AISP's captions of the same streams."""
    from faster_whisper import WhisperModel

    bare = WhisperModel(str(packaged_whisper()), device="cpu", compute_type="int8")
    refs, ours, theirs = [], [], []
    run = Captions()
    run.feed([(name, y) for name, (y, _) in voices.items()])
    run.end()
    for name, (y, truth) in voices.items():
        refs.append(" ".join(t for _, _, t in truth))
        ours.append(" ".join(c[3] for c in run.finals(name)))
        segments, _ = bare.transcribe(y, language="en", beam_size=1, temperature=0.0, without_timestamps=True)
        theirs.append(" ".join(s.text for s in segments))
    wer_ours, wer_bare = word_error_rate(refs, ours), word_error_rate(refs, theirs)
    words = sum(len(r.split()) for r in refs)
    assert wer_ours <= wer_bare + 1 / words + 1e-9, (wer_ours, wer_bare, ours, theirs)
    assert wer_ours < 0.25, ours  # and the words are there: a model that hears nothing fails
    for name, (_, truth) in voices.items():  # captions at the sentences' times (a pause may split one)
        finals = run.finals(name)
        inside = [[t for t in truth if t[0] - 0.3 < c[1] and c[2] < t[1] + 0.3] for c in finals]
        assert all(len(i) == 1 for i in inside), (finals, truth)
        assert {i[0] for i in inside} == set(truth), (finals, truth)


@pytest.mark.parametrize("seed", [11, 12])
def test_chunks_in_any_batches_give_the_whole_streams_final_captions(
    voices: dict[str, Any], seed: int
) -> None:
    """Seeded: where the streams are cut (about 100 ms apart, at random points), how many rows a
    batch; partials on (they depend on the cuts, the finals must not); clips padded to 10 s
    buckets (a clip's text must not depend on what it was batched with)."""
    ys = {name: y for name, (y, _) in voices.items()}
    whole = Captions(pad_s=10.0)
    whole.feed(list(ys.items()))
    whole.end()
    rng = np.random.default_rng(seed)
    rows = _chunked(ys, rng, 100.0)
    chunked = Captions(partial_every_s=1.0, pad_s=10.0)
    at = 0
    while at < len(rows):
        n = int(rng.integers(1, 12))
        chunked.feed(rows[at : at + n], first_id=at)
        at += n
    chunked.end()
    for name in ys:
        assert chunked.finals(name) == whole.finals(name), f"seed {seed}"
    partials = [c for c in chunked.captions if not c[4]]
    assert partials, "partial captions come while a segment is open"
    for stream, start, end, _, _ in partials:  # each inside a final's span, before its end
        assert any(f[0] == stream and f[1] == start and end <= f[2] + 0.2 for f in whole.finals()), (
            start,
            end,
        )


def test_partials_are_not_made_for_rows_that_came_in_too_long_ago(voices: dict[str, Any]) -> None:
    """Behind real time (a row older than partial_every_s), no partial: the finals are the same."""
    ys = {name: y for name, (y, _) in voices.items()}
    rows = _chunked(ys, np.random.default_rng(3), 100.0)
    fresh, late = Captions(partial_every_s=1.0), Captions(partial_every_s=1.0)
    for at in range(0, len(rows), 6):
        fresh.feed(rows[at : at + 6], first_id=at)
        late.feed(rows[at : at + 6], first_id=at, age_s=1.5 if (at // 6) % 2 else 0.0)
    fresh.end()
    late.end()
    assert late.finals() == fresh.finals()
    partials = [c for c in late.captions if not c[4]]
    assert 0 < len(partials) < len([c for c in fresh.captions if not c[4]])


def test_a_batch_with_finals_makes_no_partials_and_the_next_row_makes_them(voices: dict[str, Any]) -> None:
    """Finals first: a partial due in a batch that ends another stream's window waits for its
    stream's next row, so it does not share (and hold up) the finals' model call."""
    (y0, t0), (y1, t1) = voices["s0"], voices["s1"]
    a = y0[int(t0[0][0] * RATE) :]  # from the first sentence on: every window holds speech
    b = y1[int(t1[0][0] * RATE) :]
    run = Captions(partial_every_s=0.25, segments="windows", window_s=2.0)
    second = int(1.6 * RATE)
    run.feed([("a", a[:second]), ("b", b[:second])])
    assert sorted((c[0], c[4]) for c in run.captions) == [("a", False), ("b", False)]
    run.captions.clear()
    # a's window ends (a final); b's partial is due (0.3 s since its last) but yields to it
    run.feed([("a", a[second : second + 8000]), ("b", b[second : second + 4800])], first_id=2)
    assert [(c[0], c[4]) for c in run.captions] == [("a", True)]
    run.captions.clear()
    run.feed([("b", b[second + 4800 : second + 5600])], first_id=4)  # b's next row: its partial
    assert [(c[0], c[4]) for c in run.captions] == [("b", False)]


def test_partials_past_the_budget_wait_for_a_later_batch_the_longest_waiting_first(
    voices: dict[str, Any],
) -> None:
    """With a credit for partials of next to nothing, a batch makes one (once the model's time
    is measured): the stream whose last partial is oldest; the others are made by later batches,
    in turn. The credit grows with the time that passes (a second a batch here)."""
    clips = {n: y[int(t[0][0] * RATE) :] for n, (y, t) in zip("abc", voices.values(), strict=False)}
    run = Captions(
        partial_every_s=0.25, segments="windows", window_s=10.0, partial_budget_s=1e-9, partial_share=1.0
    )
    clock = [0.0]
    run.asr._clock, run.asr._at = lambda: clock[0], 0.0
    at = 0
    made = []
    for step in (16000, 4800, 800, 800):  # 1 s, then 0.3 s and 0.05 s more of each stream
        clock[0] += 1.0
        heard = run.spec.counters.asr_audio_seconds
        before = {n: s.partial_at for n, s in run.asr.streams.items()}
        run.feed([(n, clips[n][at : at + step]) for n in "abc"], first_id=at)
        at += step
        # the streams that got a partial (its mark moved to where their audio is now)
        made.append(sorted(n for n, s in run.asr.streams.items() if s.partial_at != before.get(n, -1)))
        assert run.spec.counters.asr_audio_seconds - heard == pytest.approx(len(made[-1]) * at / RATE)
    assert made == [["a", "b", "c"], ["a"], ["b"], ["c"]]


def test_a_restored_checkpoint_goes_on_mid_speech(voices: dict[str, Any]) -> None:
    y, truth = voices["s1"]
    whole = Captions()
    whole.feed([("a", y)])
    whole.end()
    cut = int((truth[1][0] + 0.5) * RATE)  # in the second sentence
    first = Captions()
    for at in range(0, cut, 1600):
        first.feed([("a", y[at : min(at + 1600, cut)])])
    vad, asr = first.vad.snapshot(), first.asr.snapshot()
    second = Captions()
    second.index.encode(pa.array(["a"]))
    second.vad.restore({k: pa.array(v).to_numpy(zero_copy_only=False) for k, v in vad.items()})
    second.asr.restore({k: pa.array(v).to_numpy(zero_copy_only=False) for k, v in asr.items()})
    for at in range(cut, len(y), 1600):
        second.feed([("a", y[at : at + 1600])])
    second.end()
    assert first.finals() + second.finals() == whole.finals()
    assert len(whole.finals()) >= len(truth)


def test_a_long_segment_is_cut_at_max_segment_s_and_fixed_windows_need_no_vad(voices: dict[str, Any]) -> None:
    y, _ = voices["s0"]
    cut = Captions(max_segment_s=1.0)
    cut.feed([("a", y)])
    cut.end()
    spans = [(c[1], c[2]) for c in cut.finals()]
    assert all(e - s <= 1.0 + 1e-9 for s, e in spans), spans
    assert len(spans) > 3
    windows = Captions(segments="windows", window_s=4.0)
    windows.feed([("a", y[: len(y) // 2]), ("a", y[len(y) // 2 :])])
    windows.end()
    finals = windows.finals()
    assert finals and all(c[1] % 4.0 == 0 for c in finals), finals
    assert word_error_rate([" ".join(t for *_, t in voices["s0"][1])], [" ".join(c[3] for c in finals)]) < 0.5


def test_bad_rows_go_to_the_dead_letters_and_the_others_on(voices: dict[str, Any]) -> None:
    y, truth = voices["s2"]
    run = Captions()
    nan = np.full(1600, np.nan, np.float32)
    run.feed([("a", y[: len(y) // 2]), ("b", None), ("c", nan), ("a", y[len(y) // 2 :])])
    run.end()
    reasons = dict(run.dead)
    assert set(reasons) == {1, 2}
    assert "no samples" in reasons[1] and "not finite" in reasons[2]
    assert len(run.finals("a")) >= len(truth) and not run.finals("b") and not run.finals("c")
    windows = Captions(segments="windows")  # (a keyed pipeline refuses a null key before this step)
    windows.feed([(None, y[:1600]), ("a", y)])
    assert dict(windows.dead).keys() == {0} and "no stream id" in dict(windows.dead)[0]


def test_settings_are_checked() -> None:
    for bad in (
        {"segments": "words"},
        {"task": "summarise"},
        {"max_segment_s": 31.0},
        {"window_s": 0.0},
        {"partial_every_s": -1.0},
        {"partial_budget_s": -0.1},
        {"partial_share": -0.5},
        {"pre_roll_s": 2.0},
        {"beam_size": 0},
        {"temperature": -0.1},
        {"max_batch": 0},
        {"pad_s": 0.5},
    ):
        with pytest.raises(ConfigError):
            SpeechToText(**bad)


def test_a_pipeline_captions_chunked_streams_and_counts_its_work(voices: dict[str, Any]) -> None:
    """PCM chunks of 100 ms through AudioDecode, a key by stream, SpeechSegments and
    SpeechToText in a running pipeline: every stream's captions, at the end of input too; the
    step's counters are metrics of its stage."""
    from prometheus_client.core import Metric

    from aisp import CollectSink, Pipeline, TestingSource
    from aisp.observe.export.operators import counter_families, operator_counters
    from aisp.transform.media.audio import AudioDecode

    rows = []
    for name, (y, _) in voices.items():
        pcm = (np.clip(y, -1, 1) * 32767).astype("<i2").tobytes()
        rows += [
            {"stream": name, "seq": k, "audio": pcm[at : at + 3200]}
            for k, at in enumerate(range(0, len(pcm), 3200))
        ]
    rows.sort(key=lambda r: r["seq"])
    rows.insert(5, {"stream": "s0", "seq": -1, "audio": b"\x01"})  # half a sample: a dead letter
    p, out = Pipeline("captions"), CollectSink(columns=["stream", "start_s", "end_s", "text", "final"])
    decoded = p.source("src", TestingSource(rows, batch_rows=24)).apply(
        "decode", AudioDecode(format="pcm_s16le", input_rate=RATE)
    )
    keyed = decoded.key_by("by_stream", "stream")
    vad = keyed.apply("vad", SpeechSegments(space="by_stream"))
    vad.apply("asr", SpeechToText(pad_s=10.0)).sink("out", out)
    p.run()
    finals = [r for r in out.rows if r["final"]]
    for name, (_, truth) in voices.items():
        said = " ".join(r["text"] for r in finals if r["stream"] == name)
        assert word_error_rate([" ".join(t for *_, t in truth)], [said]) < 0.3, said
    families: dict[str, Metric] = {f.name: f for f in counter_families(operator_counters(p.graph))}
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value for f in families.values() for s in f.samples
    }
    assert samples[("aisp_captions_total", (("kind", "final"), ("stage", "asr")))] == len(finals)
    audio = sum(len(y) for y, _ in voices.values()) / RATE
    assert samples[("aisp_asr_audio_seconds_total", (("stage", "asr"),))] == pytest.approx(audio, abs=0.01)
    assert samples[("aisp_asr_model_seconds_total", (("stage", "asr"),))] > 0
