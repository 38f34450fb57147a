"""The state store's engine by measurement: LMDB (``lmdb``) vs RocksDB (``rocksdict``).

The checkpoint's write pattern: 100,000 keys of 16-byte state (a count and a sum) written in one
batch per version (a 16-byte key: 8 bytes of key, 8 of version), three versions, each made
durable (LMDB: a synchronous commit; RocksDB: a write batch and a flush); then every entry read
back in order, as a restore does.

    python benchmarks/bench_state_store.py [--keys 100000]   (needs: pip install rocksdict)
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np


def entries(n: int, version: int) -> tuple[list[bytes], list[bytes]]:
    keys = np.zeros(n, dtype=[("k", ">u8"), ("v", ">u8")])
    keys["k"] = np.arange(n) * 7919
    keys["v"] = version
    kb = keys.tobytes()
    vb = np.random.default_rng(version).random((n, 2)).tobytes()
    return [kb[i * 16 : (i + 1) * 16] for i in range(n)], [vb[i * 16 : (i + 1) * 16] for i in range(n)]


def lmdb_run(path: Path, n: int) -> tuple[float, float]:
    import lmdb

    env = lmdb.open(str(path), map_size=1 << 32, sync=True)
    t = time.perf_counter()
    for v in (1, 2, 3):
        keys, values = entries(n, v)
        with env.begin(write=True) as txn:
            txn.cursor().putmulti(list(zip(keys, values, strict=True)))
    write = (time.perf_counter() - t) / 3
    t = time.perf_counter()
    with env.begin() as txn:
        count = sum(1 for _ in txn.cursor())
    read = time.perf_counter() - t
    env.close()
    assert count == 3 * n
    return write, read


def rocks_run(path: Path, n: int) -> tuple[float, float]:
    from rocksdict import Options, Rdict, WriteBatch

    db = Rdict(str(path), options=Options(raw_mode=True))
    t = time.perf_counter()
    for v in (1, 2, 3):
        keys, values = entries(n, v)
        batch = WriteBatch(raw_mode=True)
        for k, x in zip(keys, values, strict=True):
            batch.put(k, x)
        db.write(batch)
        db.flush()
    write = (time.perf_counter() - t) / 3
    t = time.perf_counter()
    count = sum(1 for _ in db.items())
    read = time.perf_counter() - t
    db.close()
    assert count == 3 * n
    return write, read


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--keys", type=int, default=100_000)
    args = ap.parse_args()
    for name, fn in (("lmdb", lmdb_run), ("rocksdict", rocks_run)):
        d = Path(tempfile.mkdtemp())
        try:
            write, read = fn(d / "db", args.keys)
        finally:
            shutil.rmtree(d)
        per_version, read_ms = write * 1000, read * 1000
        print(f"{name}: write {args.keys:,} keys {per_version:.0f} ms per version, read all {read_ms:.0f} ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
