"""The Kafka sink after restarts: a replay that interleaves the input's partitions in another
order than before the crash, and crashes before a replay is done, still leave each row once.

A seeded model of a pipeline: the input has 1-4 partitions, each replayed in its own order; a
run starts from the last checkpoint (a prefix of each input partition and the sink's position),
emits the rest interleaved at random, takes checkpoints at random points and is killed at a
random point; the last run drains. The seed is printed, so a failure replays. (A run that starts
without a checkpoint takes one at once, as the engine's ``Checkpointer`` does.)"""

from __future__ import annotations

import random
import uuid
from collections import Counter
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from aisp.batch import Batch
from aisp.connectors.kafka import read_topic, tansu_broker
from aisp.connectors.kafka.sink import KafkaSink


@pytest.fixture(scope="module")
def broker() -> Iterator[str]:
    with tansu_broker() as bootstrap:
        yield bootstrap


def _rows(ids: list[int]) -> Batch:
    arr = np.asarray(ids, dtype=np.int64)
    return Batch.from_columns({"id": arr, "v": arr * 3}, ids=arr)


def _run(
    sink: KafkaSink, start: tuple[list[int], Any], inputs: list[list[int]], rng: random.Random, *, crash: bool
) -> tuple[list[int], Any]:
    """One process: from the checkpoint ``start`` (prefix per input partition, sink position),
    emit the rest interleaved at random in batches, checkpoint now and then; returns the last
    checkpoint (the one a restart takes)."""
    done, position = list(start[0]), start[1]
    writer = sink.open() if position is None else sink.resume(position)
    if position is None:  # a run without a checkpoint to start from takes one at once
        position = writer.snapshot()
    left = [list(part[n:]) for part, n in zip(inputs, done, strict=True)]
    total = sum(map(len, left))
    stop = rng.randint(0, total) if crash else total
    emitted, checkpoint = 0, (list(done), position)
    print(f"run from {done} at {position}: {stop} of {total} rows before the {'kill' if crash else 'end'}")
    while emitted < stop:
        batch: list[int] = []
        for _ in range(min(rng.randint(1, 40), stop - emitted)):
            j = rng.choice([k for k, rest in enumerate(left) if rest])
            batch.append(left[j].pop(0))
            done[j] += 1
            emitted += 1
        writer.write(_rows(batch))
        if rng.random() < 0.3:  # a checkpoint: state (prefixes) and the sink's position together
            checkpoint = (list(done), writer.snapshot())
            writer.sync()
    if crash:
        writer.flush()  # what was written before the kill reached the broker
        return checkpoint
    writer.close()
    return list(done), None


@pytest.mark.parametrize("seed", [random.randrange(2**31) for _ in range(2)] + [7])
def test_each_row_lands_once_whatever_order_each_replay_takes(broker: str, seed: int) -> None:
    print(f"seed {seed}")
    rng = random.Random(seed)
    k = rng.randint(1, 4)
    ids = list(range(rng.randint(100, 600)))
    inputs = [[i for i in ids if i % k == j] for j in range(k)]
    topic = f"replay-{uuid.uuid4().hex[:8]}"
    tx = f"tx-{topic}" if rng.random() < 0.5 else None
    sink = KafkaSink(topic=topic, bootstrap=broker, partitions=rng.randint(1, 2), transactional_id=tx)
    checkpoint: tuple[list[int], Any] = ([0] * k, None)
    for _ in range(rng.randint(1, 3)):
        checkpoint = _run(sink, checkpoint, inputs, rng, crash=True)
    _run(sink, checkpoint, inputs, rng, crash=False)
    written = Counter()
    for p in range(sink.partitions):
        written.update(int(line.split(b'"id":')[1].split(b",")[0]) for line in read_topic(broker, topic, p))
    assert sorted(written) == ids, f"seed {seed}: lost {sorted(set(ids) - set(written))[:10]}"
    assert max(written.values()) == 1, f"seed {seed}: twice {[i for i, n in written.items() if n > 1][:10]}"
