"""The short form of the cluster scenarios (``make cluster`` runs them all, ``scripts/cluster.py``):
three worker hosts and two model hosts in network namespaces, a worker SIGKILLed while events
arrive. Every event comes out once with the state of an uninterrupted run, and the killed
worker's partitions answer again from their new owners within 15 s."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.cluster.netns import Network, unavailable
from tests.cluster.scenario import Shape, as_dict, run_fault


@pytest.fixture
def network() -> Iterator[Network]:
    why = unavailable()
    if why is not None:
        pytest.skip(f"cluster scenarios need network namespaces: {why}")
    with Network() as net:
        yield net


def test_a_killed_worker_s_partitions_move_within_15_s_and_every_event_comes_out_once(
    network: Network, tmp_path: Path
) -> None:
    report = run_fault(network, tmp_path, "worker-killed", Shape())
    text = json.dumps(as_dict(report))
    print(text)  # the measurements, for -s and the log
    assert report.lost == report.duplicated == report.unequal == 0, text
    assert report.takeover_s < 15, text
    assert report.workers_exit == {"w0": 0, "w1": -9, "w2": 0}, text
