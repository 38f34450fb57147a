"""Keyed state checkpointed per input partition (``aisp.state.partitions``): claims, writes and
releases by two owners against a model of who owns each partition and what it last wrote,
what a claim hands over, pruning per partition, and the partition locks."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from aisp.errors import StateError
from aisp.state.checkpoint import CheckpointStore
from aisp.state.partitions import PartitionStates, PartitionStateStore


def tables(offset: int) -> dict[str, pa.Table]:
    return {
        "keys.k": pa.table({"key": [f"u{offset}", f"v{offset}"]}),
        "op.stats": pa.table({"count": pa.array([offset, offset + 1], pa.int64())}),
    }


def test_a_claim_hands_over_what_the_previous_owner_wrote(tmp_path: Path) -> None:
    first = PartitionStates(tmp_path, claim_timeout_s=0)
    assert first.owned == [] and first.stats() == {"claimed": 0}
    assert first.claim(2) is None and first.claim(0) is None  # nothing written yet
    assert first.owned == [0, 2] and first.stats() == {"claimed": 2}
    assert first.write(2, tables(5), {"offset": 5, "spaces": {"stats": "k"}})
    assert first.write(2, tables(9), {"offset": 9, "spaces": {"stats": "k"}})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["p-0", "p-2"]
    first.close()
    assert first.owned == []
    second = PartitionStates(tmp_path, claim_timeout_s=0)
    checkpoint = second.claim(2)
    assert checkpoint is not None and checkpoint.id == 2
    assert checkpoint.meta == {"offset": 9, "spaces": {"stats": "k"}}
    assert sorted(checkpoint.tables) == ["keys.k", "op.stats"]
    for name, table in tables(9).items():
        assert checkpoint.tables[name].equals(table)
    assert second.claim(0) is None  # claimed before, never written
    second.close()


def test_a_partition_not_owned_is_not_written(tmp_path: Path) -> None:
    states = PartitionStates(tmp_path, claim_timeout_s=0)
    assert not states.write(4, tables(1), {"offset": 1})
    assert list(tmp_path.iterdir()) == []
    states.claim(4)
    states.release(4)
    states.release(4)  # released twice, or never claimed: nothing happens
    states.release(7)
    assert not states.write(4, tables(1), {"offset": 1})
    assert CheckpointStore(tmp_path / "p-4").ids() == []


def test_each_partition_keeps_its_newest_checkpoints(tmp_path: Path) -> None:
    states = PartitionStates(tmp_path, keep=2, claim_timeout_s=0)
    states.claim(0)
    states.claim(1)
    for offset in range(1, 6):
        assert states.write(0, tables(offset), {"offset": offset})
    assert states.write(1, tables(100), {"offset": 100})
    assert CheckpointStore(tmp_path / "p-0").ids() == [4, 5]
    assert CheckpointStore(tmp_path / "p-1").ids() == [1]
    states.close()
    again = PartitionStates(tmp_path, keep=2, claim_timeout_s=0)
    checkpoint = again.claim(0)
    assert checkpoint is not None and checkpoint.id == 5 and checkpoint.meta == {"offset": 5}
    assert again.write(0, tables(6), {"offset": 6})
    assert CheckpointStore(tmp_path / "p-0").ids() == [5, 6]
    again.close()


def test_a_partition_locked_by_another_owner_is_refused_after_the_timeout(tmp_path: Path) -> None:
    owner = PartitionStates(tmp_path, claim_timeout_s=0)
    owner.claim(1)
    other = PartitionStates(tmp_path, claim_timeout_s=0)
    with pytest.raises(StateError, match=r"^input partition 1's state stayed locked for 0 s: checkpoint dir"):
        other.claim(1)
    assert other.owned == [] and other.stats() == {"claimed": 0}
    with pytest.raises(StateError, match="stayed locked"):  # nor twice by its owner
        owner.claim(1)
    assert owner.owned == [1] and owner.stats() == {"claimed": 1}
    owner.release(1)
    assert other.claim(1) is None and other.owned == [1]
    other.close()


def test_partition_states_are_a_partition_state_store(tmp_path: Path) -> None:
    store: PartitionStateStore = PartitionStates(tmp_path)  # mypy checks the protocol
    assert store.written_before_outputs is False
    store.close()


Op = tuple[str, int, int]


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(st.sampled_from(["claim", "write", "release"]), st.integers(0, 1), st.integers(0, 2)),
        max_size=14,
    )
)
def test_claims_writes_and_releases_equal_a_model(
    tmp_path_factory: pytest.TempPathFactory, ops: list[Op]
) -> None:
    root = tmp_path_factory.mktemp("partitions")
    owners = [PartitionStates(root, keep=2, claim_timeout_s=0) for _ in range(2)]
    owner: dict[int, int] = {}  # partition -> the owner holding it
    written: dict[int, tuple[int, int]] = {}  # partition -> (checkpoint id, offset) last written
    claims = [0, 0]
    try:
        for step, (op, who, partition) in enumerate(ops):
            states = owners[who]
            if op == "claim":
                if partition in owner:  # held, by the other owner or this one
                    with pytest.raises(
                        StateError, match=f"input partition {partition}'s state stayed locked"
                    ):
                        states.claim(partition)
                else:
                    checkpoint = states.claim(partition)
                    owner[partition] = who
                    claims[who] += 1
                    if partition not in written:
                        assert checkpoint is None
                    else:
                        assert checkpoint is not None
                        assert checkpoint.id == written[partition][0]
                        assert checkpoint.meta == {"offset": written[partition][1]}
                        assert checkpoint.tables["op.stats"].equals(tables(written[partition][1])["op.stats"])
            elif op == "write":
                mine = owner.get(partition) == who
                assert states.write(partition, tables(step), {"offset": step}) is mine
                if mine:
                    written[partition] = (written.get(partition, (0, 0))[0] + 1, step)
            else:
                states.release(partition)
                if owner.get(partition) == who:
                    del owner[partition]
            for i, s in enumerate(owners):
                assert s.owned == sorted(p for p, w in owner.items() if w == i)
                assert s.stats() == {"claimed": claims[i]}
    finally:
        for s in owners:
            s.close()


# what another process's ``CheckpointStore.lock`` tries: the POSIX record lock on the lock file
HOLD = """
import fcntl, os, sys
fd = os.open(sys.argv[1], os.O_RDWR)
try:
    fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
except OSError:
    print("refused")
else:
    print("locked")
"""


def lock_from_another_process(directory: Path) -> str:
    done = subprocess.run(
        [sys.executable, "-S", "-c", HOLD, str(directory / ".lock")],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    return done.stdout.strip()


def test_a_refused_claim_in_the_owning_process_keeps_the_partition_locked(tmp_path: Path) -> None:
    owner = PartitionStates(tmp_path, claim_timeout_s=0)
    owner.claim(3)
    assert lock_from_another_process(tmp_path / "p-3") == "refused"
    with pytest.raises(StateError, match="stayed locked"):
        PartitionStates(tmp_path, claim_timeout_s=0).claim(3)  # a second claimant in this process
    try:
        assert lock_from_another_process(tmp_path / "p-3") == "refused"
    finally:
        owner.close()


def test_a_released_partition_can_be_locked_by_another_process(tmp_path: Path) -> None:
    owner = PartitionStates(tmp_path, claim_timeout_s=0)
    owner.claim(3)
    owner.release(3)
    assert lock_from_another_process(tmp_path / "p-3") == "locked"
