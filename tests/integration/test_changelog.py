"""Workers of one consumer group with keyed state in changelog topics (``--partition-state
changelog``), against the Tansu broker: each worker has its own checkpoint directory and nothing
is shared but the broker."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pytest

from aisp.connectors.kafka import read_topic, tansu_broker
from aisp.connectors.kafka.changelog import ChangelogStates, changelog_topic
from benchmarks.workload import write_events
from tests.integration.test_exactly_once import ENV, PIPELINE, aisp_run, drop_streams, redis_client
from tests.integration.test_kafka import keyed_topic, reference_run

PARTITIONS = 4


@pytest.fixture(scope="module")
def broker() -> Iterator[str]:
    with tansu_broker() as bootstrap:
        yield bootstrap


@pytest.mark.parametrize(
    ("standby", "output"),
    # the cold form (no standby) runs in `make chaos`; the campaign draws both
    # the standby form too, for the fast suite's time (under 20 minutes on 2 cores)
    [pytest.param(0, "redis", marks=pytest.mark.slow), pytest.param(1, "kafka", marks=pytest.mark.slow)],
    ids=["cold-redis", "standby-kafka-transactions"],
)
def test_workers_of_a_group_move_state_through_changelogs_across_a_kill_a_join_and_a_return(
    broker: str, tmp_path: Path, standby: int, output: str
) -> None:
    """Workload F over a 4-partition topic: two workers, one SIGKILLed mid-run, a third joining
    later, the killed one coming back (each with its own checkpoint directory; with standby
    replicas or without): every input has exactly one output and the state-dependent values
    (running count and mean per user) equal an uninterrupted single run. The Redis output keeps
    one entry per event id; the compacted Kafka output, keyed by event id and written in
    transactions that also hold the changelog records and the input offsets, may hold a replayed
    record twice (Tansu shows aborted transactions' records), always with the same value, and a
    reader keeps one per key."""
    data, expected = reference_run(tmp_path, 16_000, seed=43)
    name = uuid.uuid4().hex[:8]
    src, dst, group = f"cin-{name}", f"aisp-test-cout-{name}", f"cg-{name}"
    keyed_topic(broker, src, data.read_bytes().splitlines(), PARTITIONS)
    out_url = f"redis://127.0.0.1:6379/{dst}" if output == "redis" else f"kafka://{broker}/{dst}?compact=true"
    if output == "kafka":  # made here, so that progress can be followed from the start
        from confluent_kafka.admin import AdminClient, NewTopic  # type: ignore[attr-defined]

        admin = AdminClient({"bootstrap.servers": broker})
        for f in admin.create_topics([NewTopic(dst, 1, 1, config={"cleanup.policy": "compact"})]).values():
            f.result(10)

    seen = [0]
    counter: Any = None

    def progress() -> int:
        """Outputs written so far (a Kafka output: records read so far, replays and records of
        open transactions included)."""
        nonlocal counter
        if output == "redis":
            return int(r.xlen(dst))
        if counter is None:
            from confluent_kafka import OFFSET_BEGINNING, Consumer, TopicPartition

            # uncommitted records too: a killed worker's open transaction stays open on Tansu
            # (it never times out) until the worker returns and fences it, holding back a
            # read_committed reader meanwhile
            counter = Consumer(
                {
                    "bootstrap.servers": broker,
                    "group.id": f"count-{name}",
                    "isolation.level": "read_uncommitted",
                }
            )
            counter.assign([TopicPartition(dst, 0, OFFSET_BEGINNING)])
        seen[0] += sum(m.error() is None for m in counter.consume(num_messages=10_000, timeout=0.2))
        return seen[0]

    def written() -> list[dict[str, Any]]:
        if output == "redis":
            return [json.loads(fields[b"data"]) for _, fields in r.xrange(dst)]
        return [json.loads(line) for line in read_topic(broker, dst)]

    def worker(tag: str) -> subprocess.Popen[bytes]:
        extra = ("--rate", "250", "--standby-replicas", str(standby))
        url = out_url if output == "redis" else f"{out_url}&transactional_id={name}-{tag}"  # one per worker
        return group_worker(PIPELINE, broker, src, group, url, tmp_path, tag, *extra)

    r: Any = redis_client()
    try:
        a, b = worker("a"), worker("b")
        wait_for(lambda: progress() >= 1500, 90, "the first outputs")
        a.send_signal(signal.SIGKILL)
        a.communicate()
        wait_for(lambda: progress() >= 2500, 90, "outputs after the kill")
        c = worker("c")
        wait_for(lambda: progress() >= 3500, 90, "outputs after the join")
        a = worker("a")
        for proc in (a, b, c):
            _, err = proc.communicate(timeout=240)
            assert proc.returncode == 0, err.decode()[-3000:]
        runs = {tag: json.loads((tmp_path / f"{tag}.json").read_text()) for tag in "abc"}
        assert all(run["partitions"]["claimed"] > 0 for run in runs.values()), runs  # each took some over
        assert runs["c"]["events_in"] > 0, runs
        assert runs["b"]["partitions"]["records_written"] > 0
        assert sum(run["partitions"]["records_read"] for run in runs.values()) > 0  # restored state
        if standby:  # some takeover found a warm copy and read only its tail
            assert sum(run["partitions"]["from_standby"] for run in runs.values()) > 0, runs
        rows = written()
        if output == "redis":
            assert len(rows) == len({row["id"] for row in rows}), "an output was written twice"
        else:  # one value per key, however often a replay wrote it
            by_id: dict[Any, dict[str, Any]] = {}
            for row in rows:
                assert by_id.setdefault(row["id"], row) == row, f"event {row['id']} has two outputs"
            rows = list(by_id.values())
        rows.sort(key=lambda row: row["id"])
        if rows != expected:  # say where the difference lies: which partitions, and their offsets
            pytest.fail(difference(broker, src, group, rows, expected, runs))
        dead = b"".join(
            (tmp_path / f"{tag}.dl").read_bytes() for tag in "abc" if (tmp_path / f"{tag}.dl").exists()
        )
        assert dead.count(b"\n") >= len(data.read_bytes().splitlines()) - len(expected)
    finally:
        if counter is not None:
            counter.close()
        drop_streams(r, dst, dst)


def group_worker(
    pipeline: Path, broker: str, src: str, group: str, out_url: str, tmp_path: Path, tag: str, *extra: str,
    idle_s: float = 12,
) -> subprocess.Popen[bytes]:  # fmt: skip
    """``aisp run`` of ``pipeline`` as a worker of ``group`` with state in changelogs, its own
    checkpoint directory, dead letters and run summary under ``tmp_path`` (named by ``tag``),
    its input ended after ``idle_s`` without records."""
    cmd = [
        sys.executable, "-m", "aisp.cli", "run", str(pipeline), "--no-live",
        "--input", f"kafka://{broker}/{src}?group={group}&idle_stop_s={idle_s:g}",
        "--output", out_url, "--dead-letter", str(tmp_path / f"{tag}.dl"),
        "--checkpoint-dir", str(tmp_path / tag / "chk"), "--partition-state", "changelog",
        "--checkpoint-interval-s", "0.25", "--summary-json", str(tmp_path / f"{tag}.json"), *extra,
    ]  # fmt: skip
    return subprocess.Popen(cmd, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def difference(
    broker: str, topic: str, group: str, rows: list[dict[str, Any]], expected: list[dict[str, Any]], runs: Any
) -> str:
    """What an output differs in: missing and unequal events per input partition, and the
    group's committed offsets against each partition's end."""
    from confluent_kafka import Consumer, TopicPartition

    got = {row["id"]: row for row in rows}
    missing: dict[int, int] = {}
    unequal: dict[int, int] = {}
    for e in expected:
        p = int(e["user"][1:]) % PARTITIONS
        if e["id"] not in got:
            missing[p] = missing.get(p, 0) + 1
        elif got[e["id"]] != e:
            unequal[p] = unequal.get(p, 0) + 1
    c = Consumer({"bootstrap.servers": broker, "group.id": group})
    tps = [TopicPartition(topic, p) for p in range(PARTITIONS)]
    committed = {tp.partition: tp.offset for tp in c.committed(tps, timeout=10)}
    ends = {p: c.get_watermark_offsets(TopicPartition(topic, p), timeout=10)[1] for p in range(PARTITIONS)}
    c.close()
    return (
        f"outputs differ: {len(expected)} expected, {len(rows)} written; missing by partition {missing},"
        f" unequal by partition {unequal}; committed {committed}, ends {ends};"
        f" workers {[{k: r[k] for k in ('events_in', 'partitions')} for r in runs.values()]}"
    )


def wait_for(cond: Any, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


def test_a_restore_skips_records_of_a_checkpoint_whose_commit_never_landed(broker: str) -> None:
    """A changelog record past the group's committed offset is not restored, and the next
    checkpoint writes its key's restored value over it; a tombstone deletes a key."""
    from confluent_kafka import Consumer, TopicPartition

    name = uuid.uuid4().hex[:8]
    topic, group = f"clin-{name}", f"clg-{name}"
    keyed_topic(broker, topic, [], PARTITIONS)
    states = ChangelogStates(broker, group, topic, "p")
    assert states.claim(1) is None  # nothing yet
    spaces = {"stats": "user"}

    def tables(keys: list[str], n: list[int]) -> dict[str, pa.Table]:
        return {"keys.user": pa.table({"key": keys}), "op.stats": pa.table({"n": pa.array(n, pa.int64())})}

    commit = Consumer({"bootstrap.servers": broker, "group.id": group})

    def committed(offset: int) -> None:
        commit.commit(offsets=[TopicPartition(topic, 1, offset)], asynchronous=False)

    assert states.write(1, tables(["u1", "u2"], [1, 1]), {"offset": 10, "spaces": spaces})
    committed(10)
    assert states.write(1, tables(["u1", "u2", "u3"], [5, 1, 1]), {"offset": 20, "spaces": spaces})
    assert states.written_records == 4  # u2 unchanged: not written again
    states.release(1)  # the commit of offset 20 never lands

    again = ChangelogStates(broker, group, topic, "p")
    checkpoint = again.claim(1)
    assert checkpoint is not None and checkpoint.meta["offset"] == 10
    restored = checkpoint.tables["op.stats"].to_pydict()
    assert dict(zip(restored["_key"], restored["n"], strict=True)) == {"u1": 1, "u2": 1}
    # the replay changes nothing here; the stale u1 and u3 are written over all the same
    assert again.write(1, tables(["u1", "u2"], [1, 1]), {"offset": 20, "spaces": spaces})
    assert again.written_records == 2  # u1 again, u3 as a tombstone
    committed(20)
    again.release(1)

    third = ChangelogStates(broker, group, topic, "p").claim(1)
    assert third is not None and third.meta["offset"] == 20
    restored = third.tables["op.stats"].to_pydict()
    assert dict(zip(restored["_key"], restored["n"], strict=True)) == {"u1": 1, "u2": 1}
    assert changelog_topic(group, topic, "stats") in again._topics().values()
    commit.close()


def test_a_worker_with_a_local_copy_reads_only_what_others_wrote_after_it(
    broker: str, tmp_path: Path
) -> None:
    """A worker that owned a partition takes it back from its local copy plus the changelog's
    tail (another owner's records meanwhile); a copy past the committed offset is not used."""
    from confluent_kafka import Consumer, TopicPartition

    name = uuid.uuid4().hex[:8]
    topic, group = f"cloc-{name}", f"cgl-{name}"
    keyed_topic(broker, topic, [], PARTITIONS)
    spaces = {"stats": "user"}

    def tables(state: dict[str, int]) -> dict[str, pa.Table]:
        keys = sorted(state)
        n = pa.array([state[k] for k in keys], pa.int64())
        return {"keys.user": pa.table({"key": keys}), "op.stats": pa.table({"n": n})}

    commit = Consumer({"bootstrap.servers": broker, "group.id": group})

    def committed(offset: int) -> None:
        commit.commit(offsets=[TopicPartition(topic, 1, offset)], asynchronous=False)

    def restored(states: ChangelogStates) -> tuple[int, dict[str, int]]:
        checkpoint = states.claim(1)
        assert checkpoint is not None
        table = checkpoint.tables["op.stats"].to_pydict()
        return checkpoint.meta["offset"], dict(zip(table["_key"], table["n"], strict=True))

    a = ChangelogStates(broker, group, topic, "p", local_dir=tmp_path / "a")
    assert a.claim(1) is None
    assert a.write(1, tables({"u1": 1, "u2": 1}), {"offset": 10, "spaces": spaces})
    committed(10)
    assert a.write(1, tables({"u1": 5, "u2": 1, "u3": 1}), {"offset": 20, "spaces": spaces})
    committed(20)
    a.close()  # releases the partition: its local copy covers offset 20

    b = ChangelogStates(broker, group, topic, "p", local_dir=tmp_path / "b")
    assert restored(b) == (20, {"u1": 5, "u2": 1, "u3": 1})
    assert b.stats()["records_read"] == 4  # u1 and u2, then u1 and u3
    assert b.write(1, tables({"u1": 5, "u3": 2}), {"offset": 30, "spaces": spaces})  # u2 deleted
    committed(30)
    b.close()

    again = ChangelogStates(broker, group, topic, "p", local_dir=tmp_path / "a")
    assert restored(again) == (30, {"u1": 5, "u3": 2})
    assert again.stats()["from_local"] == 1
    assert again.stats()["records_read"] == 2  # b's records only: u3 and u2's tombstone
    assert again.write(1, tables({"u1": 6, "u3": 2}), {"offset": 40, "spaces": spaces})
    again.close()  # the commit of offset 40 never lands: its copies are not used

    last = ChangelogStates(broker, group, topic, "p", local_dir=tmp_path / "a")
    assert restored(last) == (30, {"u1": 5, "u3": 2})
    assert last.stats()["from_local"] == 0
    last.close()
    commit.close()


def test_a_transactional_output_commits_changelog_records_with_its_outputs(broker: str) -> None:
    """With a transactional Kafka output on the cluster, a checkpoint's changelog records go into
    the output's transaction: a ``read_committed`` reader sees neither them nor the interval's
    outputs before the output's ``sync`` commits, and both after; rows delivered meanwhile wait
    for that commit. A restore reads them and, before the group's offsets cover them, skips them."""
    from confluent_kafka import Consumer, TopicPartition

    from aisp.batch import Batch
    from aisp.connectors.kafka import KafkaSink

    name = uuid.uuid4().hex[:8]
    topic, group, out = f"ctx-{name}", f"ctg-{name}", f"ctxo-{name}"
    keyed_topic(broker, topic, [], PARTITIONS)
    states = ChangelogStates(broker, group, topic, "p")
    writer = KafkaSink(topic=out, bootstrap=broker, transactional_id=f"tx-{name}").open()
    assert writer.take_state_writes(states)
    assert states.claim(2) is None
    spaces = {"stats": "user"}
    tables = {"keys.user": pa.table({"key": ["u1", "u2"]}), "op.stats": pa.table({"n": pa.array([3, 4])})}
    log = changelog_topic(group, topic, "stats")

    def committed_records(topic: str) -> list[Any]:
        from confluent_kafka import OFFSET_BEGINNING

        reader = Consumer({"bootstrap.servers": broker, "group.id": f"r-{name}", "enable.auto.commit": False})
        part = 2 if topic == log else 0
        reader.assign([TopicPartition(topic, part, OFFSET_BEGINNING)])
        got: list[Any] = []
        deadline = time.monotonic() + 3
        while time.monotonic() < deadline:
            got += [m for m in reader.consume(num_messages=1000, timeout=0.2) if m.error() is None]
        reader.close()
        return got

    writer.write(Batch.from_columns({"x": [1, 2, 3]}, ids=np.array([10, 20, 30])))
    position = writer.snapshot()  # the barrier: flushed, not committed
    assert states.write(2, tables, {"offset": 7, "spaces": spaces})
    assert committed_records(out) == [] and committed_records(log) == []

    later = threading.Thread(target=writer.write, args=(Batch.from_columns({"x": [4]}, ids=np.array([40])),))
    later.start()  # waits for the commit: the next interval's row is not in this transaction
    time.sleep(0.3)
    assert later.is_alive()
    writer.sync()
    later.join(10)
    assert not later.is_alive()
    assert [m.key() for m in committed_records(out)] == [b"10", b"20", b"30"]
    assert position == {"next": {"0": 3}}
    assert len(committed_records(log)) == 3  # the layout, u1 and u2
    writer.close()  # commits the later row
    states.close()

    commit = Consumer({"bootstrap.servers": broker, "group.id": group})
    commit.commit(offsets=[TopicPartition(topic, 2, 5)], asynchronous=False)  # never reached 7
    commit.close()
    again = ChangelogStates(broker, group, topic, "p")
    checkpoint = again.claim(2)
    assert checkpoint is not None and checkpoint.meta["offset"] == 5
    assert "op.stats" not in checkpoint.tables  # the records covering offset 7 are skipped
    again.close()


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--partition-state", "changelog"], "needs a single Kafka input"),
        (["--partition-state", "changelog", "--standby-replicas", "-1"], "0 or more"),
        (["--standby-replicas", "1"], "need --partition-state changelog"),
    ],
)
def test_changelog_options_that_cannot_work_are_refused_clearly(
    tmp_path: Path, extra: list[str], message: str
) -> None:
    data = tmp_path / "events.jsonl"
    write_events(data, 10, seed=1)
    cmd = [*aisp_run(data, tmp_path / "out.jsonl"), "--checkpoint-dir", str(tmp_path / "chk"), *extra]
    res = subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=120)
    assert res.returncode != 0
    assert message in " ".join(res.stderr.split()), res.stderr[-2000:]
