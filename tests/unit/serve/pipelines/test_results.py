"""ResultTracker: each event's outcome, in request order, whatever path its rows took (an event
with several output rows answers them as one JSON array line)."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from aisp.batch import PARTIAL, SOURCE, Batch
from aisp.serve.pipelines.service import Chunk, ResultTracker
from aisp.sinks.base import RowEncoder


def rows(ids: list[int], values: list[int]) -> Batch:
    return Batch.from_columns({"v": np.asarray(values, dtype=np.int64)}, ids=np.asarray(ids, dtype=np.int64))


def answer(chunk: Chunk) -> list[object]:
    assert chunk.done.is_set()
    return [json.loads(line) for line in chunk.lines(0, chunk.n).splitlines()]


def test_outputs_drops_errors_and_several_rows_per_event() -> None:
    tracker = ResultTracker("out", RowEncoder(["v"]))
    chunk = Chunk(100, 5)
    tracker.add(chunk)
    source = rows([100, 101, 102, 103, 104], [0, 1, 2, 3, 4])
    # a filter drops 101; a flat map gives 103 two rows (one now, one in a later batch) and 104 two in one
    kept = rows([100, 102, 103, 104, 104, 103], [0, 2, 30, 40, 41, 31])
    tracker.forwarded("explode", source, [("out", kept)])
    tracker.failed("score", rows([102], [2]), "deadline passed")
    tracker.written("out", rows([104, 100, 103, 104], [40, 0, 30, 41]))
    assert not chunk.done.is_set()
    tracker.written("out", rows([103], [31]))
    assert answer(chunk) == [
        {"v": 0},
        {"dropped": "explode"},
        {"error": "deadline passed", "step": "score"},
        [{"v": 30}, {"v": 31}],
        [{"v": 40}, {"v": 41}],
    ]
    assert tracker.open_chunks == 0


def test_a_prefix_is_answered_as_it_completes() -> None:
    tracker = ResultTracker("out", RowEncoder(["v"]))
    woken: list[int] = []
    chunk = Chunk(0, 4, notify=lambda: woken.append(chunk.prefix))
    tracker.add(chunk)
    tracker.written("out", rows([1, 0], [1, 0]))
    assert chunk.prefix == 2 and woken == [2]
    assert chunk.lines(0, 2) == b'{"v":0}\n{"v":1}\n'
    tracker.written("out", rows([3], [3]))
    assert chunk.prefix == 2  # event 2 is still open
    tracker.written("out", rows([2], [2]))
    assert chunk.prefix == 4 and woken == [2, 4] and answer(chunk) == [{"v": v} for v in range(4)]


@settings(max_examples=60, deadline=None)
@given(
    counts=st.lists(st.integers(0, 3), min_size=1, max_size=30),
    seed=st.integers(0, 2**32 - 1),
    batches=st.integers(1, 4),
)
def test_every_output_row_lands_in_its_event_in_order(counts: list[int], seed: int, batches: int) -> None:
    """Any number of output rows per event (0: dropped), written in shuffled batches: each event
    answers its rows in the order they were written."""
    rng = np.random.default_rng(seed)
    n = len(counts)
    tracker = ResultTracker("out", RowEncoder(["v"]))
    chunk = Chunk(0, n)
    tracker.add(chunk)
    out_ids = np.repeat(np.arange(n), counts)
    values = np.arange(out_ids.size)  # the order rows are emitted in, per event ascending
    tracker.forwarded(
        "fan", rows(list(range(n)), [0] * n), [("out", rows(out_ids.tolist(), values.tolist()))]
    )
    order = rng.permutation(out_ids.size)
    pieces = np.array_split(np.sort(order), batches) if out_ids.size else []
    for piece in pieces:  # events interleave at random; each event's rows stay in order
        shuffled = piece[rng.permutation(piece.size)]
        events = out_ids[shuffled]
        for event in np.unique(events):
            at = np.flatnonzero(events == event)
            shuffled[at] = np.sort(shuffled[at])
        if shuffled.size:
            tracker.written("out", rows(out_ids[shuffled].tolist(), values[shuffled].tolist()))
    expected: list[object] = []
    for event, k in enumerate(counts):
        got = [{"v": int(v)} for v in values[out_ids == event]]
        expected.append({"dropped": "fan"} if k == 0 else got[0] if k == 1 else got)
    assert answer(chunk) == expected


@pytest.mark.parametrize("n", [1, 1000])
def test_one_row_per_event_in_one_batch(n: int) -> None:
    tracker = ResultTracker("out", RowEncoder(["v"]))
    chunk = Chunk(7, n)
    tracker.add(chunk)
    tracker.written("out", rows(list(range(7, 7 + n)), list(range(n))))
    assert chunk.lines(0, n) == b"".join(b'{"v":%d}\n' % i for i in range(n))


def pieces(ids: list[int], tokens: list[str]) -> Batch:
    return Batch.from_columns(
        {"token": tokens, PARTIAL: np.ones(len(ids), dtype=bool)}, ids=np.asarray(ids, dtype=np.int64)
    )


def test_pieces_of_results_stream_before_their_event_and_wait_behind_earlier_ones() -> None:
    tracker = ResultTracker("out", RowEncoder(["v"]))
    moved: list[int] = []
    chunk = Chunk(10, 2, notify=lambda: moved.append(1))
    tracker.add(chunk)
    tracker.forwarded("map", pieces([10, 11], ["a", "x"]), [])  # pieces open and close nothing
    tracker.written("side", pieces([10], ["not the result step's"]))
    tracker.written("out", pieces([11, 10], ["x", "a"]))
    assert moved and not chunk.done.is_set()
    # event 10 is the one the response waits for: its piece goes now; 11's waits behind it
    assert [json.loads(x) for x in chunk.stream(0, chunk.prefix).splitlines()] == [{"token": "a"}]
    tracker.written("out", pieces([10], ["b"]))
    tracker.written("out", rows([10], [1]))
    assert chunk.prefix == 1
    got = [json.loads(x) for x in chunk.stream(0, chunk.prefix).splitlines()]
    assert got == [{"token": "b"}, {"v": 1}, {"token": "x"}]
    tracker.failed("llm", pieces([11], ["?"]), "ignored: pieces carry no outcome")
    tracker.written("out", rows([11], [2]))
    assert chunk.done.is_set() and chunk.stream(1, 2) == b'{"v":2}\n'


def derived(sources: list[int], values: list[int], first_id: int = 10_000) -> Batch:
    """Rows a step made with ids of their own (frames, captions), each naming its event."""
    return Batch.from_columns(
        {"v": np.asarray(values, dtype=np.int64), SOURCE: np.asarray(sources, dtype=np.int64)},
        ids=np.arange(first_id, first_id + len(sources), dtype=np.int64),
    )


@settings(max_examples=60, deadline=None)
@given(counts=st.lists(st.integers(0, 3), min_size=1, max_size=20), seed=st.integers(0, 2**32 - 1))
def test_rows_made_with_their_own_ids_answer_the_events_they_name(counts: list[int], seed: int) -> None:
    """A video step makes frames and sound rows of chunk events (any number, 0: the chunk waits
    for more), a later step makes captions of several of those rows at once: each event answers
    with the rows made of it, through both steps."""
    rng = np.random.default_rng(seed)
    n = len(counts)
    tracker = ResultTracker("out", RowEncoder(["v"]))
    chunk = Chunk(0, n)
    tracker.add(chunk)
    made = np.repeat(np.arange(n), counts)
    first = derived(made.tolist(), list(range(made.size)))
    tracker.forwarded("video", rows(list(range(n)), [0] * n), [("out", first)])
    # the next step takes every row and makes one caption of each event's rows (none of some)
    events = np.unique(made)
    keep = events[rng.random(events.size) < 0.7]
    second = derived(keep.tolist(), (100 + keep).tolist(), first_id=20_000)
    tracker.forwarded("asr", first, [("out", second)])
    tracker.written("out", second.take(rng.permutation(second.num_rows)))
    got = answer(chunk)
    for event in range(n):
        if event in keep:
            assert got[event] == {"v": 100 + event}
        else:
            assert got[event] == {"dropped": "video" if counts[event] == 0 else "asr"}
