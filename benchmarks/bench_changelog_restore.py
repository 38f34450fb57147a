"""Restore time of keyed state from changelog topics, against state size, with standby replicas
on and off.

For each state size (``--keys``, workload F's per-user state: a count and a mean per key), a
worker owning input partition 0 writes every key to the changelog (one checkpoint) and the
group commits its offset. Then, alternating for ``--rounds`` rounds:

* cold: a new worker takes partition 0 over and reads its changelog from the start;
* standby: a worker that keeps a standby replica of partition 0 (``standby_replicas=1``) has
  tailed the changelog; the owner writes one more checkpoint (``--tail`` of the keys changed)
  and commits, and the standby worker takes the partition over, reading only the tail;
* local: a worker restarted with the checkpoint directory it had when it last owned partition 0
  (a local copy of the state then) takes it over after the owner wrote one more checkpoint: it
  loads the copy and reads only the changelog records after it.

Restore time is from the takeover call to the state in hand (tables built), median of the
rounds; each taking worker was started at least a second before (as a running worker was, when
it joined its group), so its clients are connected. The broker is Tansu (memory storage) started here.

    python benchmarks/bench_changelog_restore.py [--keys 10000 100000 1000000] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

import numpy as np
import pyarrow as pa

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))
from aisp.connectors.kafka import tansu_broker  # noqa: E402
from aisp.connectors.kafka.changelog import ChangelogStates  # noqa: E402

SPACES = {"user_stats": "user"}


def tables(keys: pa.Array, n: np.ndarray, mean: np.ndarray) -> dict[str, pa.Table]:
    """One checkpoint's capture: copies, as the engine's are (the store keeps them to compare)."""
    columns = {"n": n.copy(), "mean_amount": mean.copy()}
    return {"keys.user": pa.table({"key": keys}), "op.user_stats": pa.table(columns)}


def commit(bootstrap: str, group: str, topic: str, offset: int) -> None:
    from confluent_kafka import Consumer, TopicPartition

    c = Consumer({"bootstrap.servers": bootstrap, "group.id": group})
    c.commit(offsets=[TopicPartition(topic, 0, offset)], asynchronous=False)
    c.close()


def one_size(bootstrap: str, keys: int, rounds: int, tail: float) -> dict[str, object]:
    from confluent_kafka.admin import AdminClient, NewTopic  # type: ignore[attr-defined]

    name = uuid.uuid4().hex[:6]
    topic, group = f"in-{name}", f"g-{name}"
    admin = AdminClient({"bootstrap.servers": bootstrap})  # alive until the futures are done
    for f in admin.create_topics([NewTopic(topic, 1, 1)]).values():
        f.result(10)
    key_array = pa.array([f"u{i}" for i in range(keys)])
    n = np.ones(keys, dtype=np.int64)
    mean = np.random.default_rng(1).random(keys)
    owner = ChangelogStates(bootstrap, group, topic, "fraud")
    owner.claim(0)
    t0 = time.perf_counter()
    owner.write(0, tables(key_array, n, mean), {"offset": keys, "spaces": SPACES})
    write_s = time.perf_counter() - t0
    offset = keys
    commit(bootstrap, group, topic, offset)
    cold, warm, local, tails = [], [], [], []
    kinds = ("cold", "standby", "local")
    for r in range(rounds):
        for kind in kinds[r % 3 :] + kinds[: r % 3]:
            if kind == "local":
                with tempfile.TemporaryDirectory() as tmp:
                    before = ChangelogStates(bootstrap, group, topic, "fraud", local_dir=tmp)
                    before.claim(0)
                    before.close()  # its local copy covers the state until now
                    changed = int(keys * tail)
                    n[:changed] += 1
                    offset += changed
                    owner.write(0, tables(key_array, n, mean), {"offset": offset, "spaces": SPACES})
                    commit(bootstrap, group, topic, offset)
                    worker = ChangelogStates(bootstrap, group, topic, "fraud", local_dir=tmp)
                    time.sleep(1.0)  # as for the cold worker
                    t0 = time.perf_counter()
                    checkpoint = worker.claim(0)
                    local.append(time.perf_counter() - t0)
                    assert checkpoint is not None and worker.stats()["from_local"] == 1
                    restored = checkpoint.tables["op.user_stats"]
                    total = int(pa.compute.sum(restored.column("n")).as_py())
                    assert restored.num_rows == keys and total == int(n.sum())
                    worker.close()
                continue
            if kind == "cold":
                worker = ChangelogStates(bootstrap, group, topic, "fraud")
                time.sleep(1.0)  # a running worker: its clients connected when it started
                t0 = time.perf_counter()
                checkpoint = worker.claim(0)
                cold.append(time.perf_counter() - t0)
                assert checkpoint is not None and checkpoint.tables["op.user_stats"].num_rows == keys
                worker.close()
                continue
            standby = ChangelogStates(bootstrap, group, topic, "fraud", standby_replicas=1)
            assert standby._standby is not None
            time.sleep(1.0)  # as for the cold worker
            deadline = time.monotonic() + 600
            while standby._standby.warm.get(0, 0) < owner.written_records and time.monotonic() < deadline:
                time.sleep(0.05)  # the standby replica catches up with the changelog
            changed = int(keys * tail)
            n[:changed] += 1  # one more checkpoint: these keys changed
            offset += changed
            before = owner.written_records
            owner.write(0, tables(key_array, n, mean), {"offset": offset, "spaces": SPACES})
            commit(bootstrap, group, topic, offset)
            tails.append(owner.written_records - before)
            t0 = time.perf_counter()
            checkpoint = standby.claim(0)
            warm.append(time.perf_counter() - t0)
            assert checkpoint is not None and standby.stats()["from_standby"] == 1
            restored = checkpoint.tables["op.user_stats"]
            assert restored.num_rows == keys and int(pa.compute.sum(restored.column("n")).as_py()) == int(
                n.sum()
            )
            standby.close()
    owner.close()
    return {
        "keys": keys,
        "write_s": round(write_s, 3),
        "write_records_per_s": round(keys / write_s),
        "cold_restore_s": [round(x, 3) for x in cold],
        "cold_median_s": round(statistics.median(cold), 3),
        "cold_records_per_s": round(keys / statistics.median(cold)),
        "standby_restore_s": [round(x, 3) for x in warm],
        "standby_median_s": round(statistics.median(warm), 3),
        "standby_tail_records": tails,
        "cold_over_standby": round(statistics.median(cold) / statistics.median(warm), 1),
        "local_restore_s": [round(x, 3) for x in local],
        "local_median_s": round(statistics.median(local), 3),
        "cold_over_local": round(statistics.median(cold) / statistics.median(local), 1),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--keys", type=int, nargs="+", default=[10_000, 100_000, 1_000_000])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument(
        "--tail", type=float, default=0.01, help="share of the keys changed after the standby caught up"
    )
    args = ap.parse_args()
    with tansu_broker() as bootstrap:
        for keys in args.keys:
            print(json.dumps(one_size(bootstrap, keys, args.rounds, args.tail)), flush=True)


if __name__ == "__main__":
    main()
