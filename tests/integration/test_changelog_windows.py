"""Window steps in changelog topics: the windows example read from a 4-partition topic by the
workers of one group (``--partition-state changelog``), one SIGKILLed mid-run, a third joining
later, the killed one coming back. A key's open windows, and how far its partition has read in
event time, move with the partition, so the windows equal those of the example's reference run
over each partition on its own (a window step decides by its row's partition's watermark when
state follows partitions), each window written once, every late event dead-lettered."""

from __future__ import annotations

import json
import math
import signal
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from aisp.connectors.kafka import tansu_broker
from tests.integration.test_changelog import group_worker, wait_for
from tests.integration.test_exactly_once import drop_streams, redis_client
from tests.integration.test_kafka import keyed_topic
from tests.integration.test_windows_example import EXAMPLE, events

PARTITIONS = 4


@pytest.fixture(scope="module")
def broker() -> Iterator[str]:
    with tansu_broker() as bootstrap:
        yield bootstrap


def per_partition_reference(rows: list[dict[str, Any]]) -> tuple[dict[Any, dict[str, Any]], list[int]]:
    """The example's reference run over each partition's events alone (in topic order)."""
    windows: dict[Any, dict[str, Any]] = {}
    late: list[int] = []
    for p in range(PARTITIONS):
        got, missed = events.reference([e for e in rows if int(e["user"][1:]) % PARTITIONS == p])
        windows.update({(w["user"], w["window_start"]): w for w in got})
        late += missed
    return windows, sorted(late)


@pytest.mark.slow  # `make chaos` (a minute: the fast suite stays under 20 minutes on 2 cores)
def test_windows_move_with_their_partitions_across_a_kill_a_join_and_a_return(
    broker: str, tmp_path: Path
) -> None:
    rows = events.make_events(9_000, seed=11, users=24)
    # each partition ends with an event of its own user far enough ahead to close every window:
    # windows close by watermarks, as in a stream that goes on, not by whichever worker happens
    # to own a partition when a bounded run ends (its end-of-input flush)
    last = max(e["ts"] for e in rows) + 2 * (events.SIZE_MS + events.LATENESS_MS + events.OUT_OF_ORDER_MS)
    rows += [{"id": 9_000 + p, "user": f"u{100 + p}", "ts": last, "amount": 1.0} for p in range(PARTITIONS)]
    expected, late = per_partition_reference(rows)
    expected = {k: w for k, w in expected.items() if int(k[0][1:]) < 100}
    assert len(late) > 20 and len(expected) > 300  # the input exercises both
    name = uuid.uuid4().hex[:8]
    src, dst, group = f"win-{name}", f"aisp-test-wout-{name}", f"wg-{name}"
    keyed_topic(broker, src, [json.dumps(e).encode() for e in rows], PARTITIONS)

    def worker(tag: str) -> subprocess.Popen[bytes]:
        out = f"redis://127.0.0.1:6379/{dst}"
        return group_worker(
            EXAMPLE / "pipeline.py", broker, src, group, out, tmp_path, tag, "--rate", "300", idle_s=10
        )

    r: Any = redis_client()
    try:
        a, b = worker("a"), worker("b")
        wait_for(lambda: r.xlen(dst) >= 60, 120, "the first windows")
        a.send_signal(signal.SIGKILL)
        a.communicate()
        wait_for(lambda: r.xlen(dst) >= 120, 120, "windows after the kill")
        c = worker("c")
        wait_for(lambda: r.xlen(dst) >= 180, 120, "windows after the join")
        a = worker("a")
        for proc in (a, b, c):
            _, err = proc.communicate(timeout=240)
            assert proc.returncode == 0, err.decode()[-3000:]
        runs = {tag: json.loads((tmp_path / f"{tag}.json").read_text()) for tag in "abc"}
        assert all(run["partitions"]["claimed"] > 0 for run in runs.values()), runs
        assert sum(run["partitions"]["records_read"] for run in runs.values()) > 0  # windows restored
        got = [json.loads(fields[b"data"]) for _, fields in r.xrange(dst)]
        got = [w for w in got if int(w["user"][1:]) < 100]  # not the closing events' own windows
        key = lambda w: (w["user"], w["window_start"])  # noqa: E731
        assert len(got) == len({key(w) for w in got}), "a window was written twice"
        missing, extra = set(expected) - {key(w) for w in got}, {key(w) for w in got} - set(expected)
        assert not missing and not extra, (
            f"windows missing {sorted(missing)[:10]} ({len(missing)}), unexpected {sorted(extra)[:10]}"
            f" ({len(extra)}); partitions {sorted({int(k[0][1:]) % PARTITIONS for k in missing | extra})};"
            f" workers {[{k: r[k] for k in ('events_in', 'partitions')} for r in runs.values()]}"
        )
        for w in got:
            e = expected[key(w)]
            assert (w["window_end"], w["n"], w["max"]) == (e["window_end"], e["n"], e["max"]), (w, e)
            assert math.isclose(w["sum"], e["sum"], rel_tol=1e-9), (w, e)
        dead = [
            json.loads(line)
            for tag in "abc"
            if (tmp_path / f"{tag}.dl").exists()
            for line in (tmp_path / f"{tag}.dl").read_text().splitlines()
        ]
        # a late event replayed after the kill may be dead-lettered again: the ids, once each
        assert sorted({d["row"]["id"] for d in dead if d["reason"] == "late"}) == late
    finally:
        drop_streams(r, dst, dst)
