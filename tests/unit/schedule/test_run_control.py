"""The Checkpointer's timing: a run that did not start from a checkpoint takes its first at
once (a crash before it must not leave the restart without a sink position); a restored run
waits its interval."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from aisp.schedule.run_control import Checkpointer


def _executor(restored: bool) -> Any:
    taken: list[object] = []
    return SimpleNamespace(
        restored=restored,
        stopping=False,
        keyed=SimpleNamespace(over_bound=lambda: False),
        checkpoints=SimpleNamespace(checkpoint=lambda store: taken.append(store) or len(taken)),
        taken=taken,
    )


@pytest.mark.parametrize("interval_s", [0.5, 5.0, 3600.0])
def test_a_fresh_run_checkpoints_at_its_first_poll_and_a_restored_one_after_its_interval(
    interval_s: float,
) -> None:
    fresh, restored = _executor(False), _executor(True)
    store: Any = object()
    for ex in (fresh, restored):
        Checkpointer(ex, store, interval_s).poll()
    assert fresh.taken == [store]
    assert restored.taken == []


def test_without_a_store_nothing_is_taken() -> None:
    ex = _executor(False)
    Checkpointer(ex, None, 1.0).poll()
    assert ex.taken == []
