"""A capacity model of AISP workers in a Kafka consumer group: 1 -> 64 workers on workload F.

Kafka places partitions, and with them keys and their state, on workers; a partition is never
split. So what one machine sustains (measured) and how unevenly keys fall on partitions (Zipf-
skewed users, hashed to partitions as a keyed producer does) decide how many workers and
partitions a rate needs; state size and the changelog's read rate decide how long a failover
takes. This script computes both from its inputs, and with ``--measure`` first measures the
restore rate here (a worker taking a partition over from its changelog topic on a real Tansu
broker, ``bench_changelog_restore``).

Inputs (defaults: the figures measured on this project's 2-vCPU VM, BENCHMARKS.md):

* ``--worker-rate``: events/s one worker sustains reading Kafka (111,514: ``bench_kafka_partitions``);
* ``--utilisation``: the share of it a worker may run at and keep p99 < 50 ms (0.8: workload F
  paced at 80% of its maximum had p99 15-25 ms);
* ``--users``, ``--zipf``: keys and their skew (workload F: 100,000 users; Zipf 1.1 skewed);
* ``--restore-rate``: records/s a worker restores a partition from its changelog, read and built
  into state columns (129,388: 1M keys, ``bench_changelog_restore``; ``--measure``: measured here);
* ``--apply-rate``: records/s the engine loads restored rows into its keyed state (1.4M, as the
  state store takes them); a restore runs at ``1 / (1/restore + 1/apply)``;
* ``--state-bytes``: bytes of state per key (the running count and mean: ~40 with its key);
* ``--changed-share``: the share of keys a checkpoint interval changes (standby replicas
  restore only that tail).

    python benchmarks/capacity_model.py [--measure] [--target 218000] [--zipf 1.1]
"""

from __future__ import annotations

import argparse
import json
import zlib
from typing import Any

import numpy as np

WORKERS = (1, 2, 4, 8, 16, 32, 64)
PARTITIONS_PER_WORKER = (1, 2, 4, 8)


def key_shares(users: int, zipf: float) -> np.ndarray:
    """Each user's share of the events (uniform, or Zipf with exponent ``zipf`` > 0)."""
    if zipf <= 0:
        return np.full(users, 1.0 / users)
    weights = 1.0 / np.arange(1, users + 1) ** zipf
    return weights / weights.sum()


def partition_shares(shares: np.ndarray, partitions: int) -> tuple[np.ndarray, np.ndarray]:
    """Each partition's share of the events and of the keys: users hashed to partitions
    (CRC-32 of the key, standing in for the producer's murmur2: both spread keys uniformly)."""
    part = np.array([zlib.crc32(f"u{i}".encode()) % partitions for i in range(shares.shape[0])])
    events = np.bincount(part, weights=shares, minlength=partitions)
    keys = np.bincount(part, minlength=partitions).astype(np.float64)
    return events, keys


def plan(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Per (workers, partitions): the rate the group sustains, the busiest worker's share, and
    the time a failed worker's partitions take to restore, with and without standbys."""
    shares = key_shares(args.users, args.zipf)
    usable = args.worker_rate * args.utilisation
    restore = 1 / (1 / args.restore_rate + 1 / args.apply_rate)
    rows = []
    for workers in WORKERS:
        for per in PARTITIONS_PER_WORKER:
            partitions = workers * per
            events, keys = partition_shares(shares, partitions)
            order = np.argsort(events)[::-1]  # the group places the heaviest first, on the least loaded
            load = np.zeros(workers)
            held_keys = np.zeros(workers)
            for p in order.tolist():
                w = int(np.argmin(load))
                load[w] += events[p]
                held_keys[w] += keys[p]
            busiest = float(load.max())
            sustained = usable / busiest  # the group's rate when its busiest worker is at its limit
            restore_keys = float(held_keys.max())  # the worst failover: the busiest worker's keys
            rows.append({
                "workers": workers, "partitions": partitions,
                "busiest_share": round(busiest, 4), "even_share": round(1 / workers, 4),
                "sustained_events_per_s": round(sustained),
                "failover_restore_s": round(restore_keys / restore, 3),
                "failover_restore_s_standby": round(restore_keys * args.changed_share / restore, 3),
                "state_mb_per_worker": round(restore_keys * args.state_bytes / 1e6, 2),
            })  # fmt: skip
    return rows


def measure_restore_rate(records: int) -> float:
    """Records/s a worker restores a partition from its changelog at a takeover, end to end
    (``bench_changelog_restore``: ``records`` keys of workload F's state written, read back from
    the start by a new worker of a Tansu broker started here, sorted by the committed offset and
    built into state columns)."""
    from aisp.connectors.kafka import tansu_broker
    from benchmarks.bench_changelog_restore import one_size

    with tansu_broker() as bootstrap:
        return float(one_size(bootstrap, records, 1, 0.01)["cold_records_per_s"])  # type: ignore[arg-type]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", type=float, default=218_000.0, help="events/s to plan for")
    parser.add_argument("--worker-rate", type=float, default=111_514.0)
    parser.add_argument("--utilisation", type=float, default=0.8)
    parser.add_argument("--users", type=int, default=100_000)
    parser.add_argument("--zipf", type=float, default=1.1)
    parser.add_argument("--restore-rate", type=float, default=129_388.0, help="records/s a takeover restores")
    parser.add_argument("--apply-rate", type=float, default=1_400_000.0)
    parser.add_argument("--state-bytes", type=float, default=40.0)
    parser.add_argument("--changed-share", type=float, default=0.05)
    parser.add_argument("--measure", action="store_true", help="measure the restore rate on a Tansu broker")
    parser.add_argument("--records", type=int, default=200_000)
    args = parser.parse_args(argv)
    if args.measure:
        args.restore_rate = measure_restore_rate(args.records)
    rows = plan(args)
    fits = [r for r in rows if r["sustained_events_per_s"] >= args.target]
    best = min(fits, key=lambda r: (r["workers"], r["partitions"])) if fits else None
    print(f"{'workers':>7} {'parts':>5} {'busiest':>8} {'even':>6} {'sustained ev/s':>15} "
          f"{'restore s':>9} {'standby s':>9} {'state MB':>8}")  # fmt: skip
    for r in rows:
        print(f"{r['workers']:>7} {r['partitions']:>5} {r['busiest_share']:>8.4f} {r['even_share']:>6.4f} "
              f"{r['sustained_events_per_s']:>15,} {r['failover_restore_s']:>9.3f} "
              f"{r['failover_restore_s_standby']:>9.3f} {r['state_mb_per_worker']:>8.2f}")  # fmt: skip
    report = {"inputs": {k: v for k, v in vars(args).items() if k not in ("measure",)}, "smallest_fit": best}
    print(json.dumps(report, indent=2))
    return 0 if best is not None else 1


if __name__ == "__main__":
    raise SystemExit(main())
