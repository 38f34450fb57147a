"""Window state as a log of changes (``aisp.state.window_log``): a restore to any kept version
gives exactly the windows a model of bases, changed rows and closed windows holds at that
version (in a fresh log over the reopened store too, and after the abandoned timeline is
discarded), old entries are deleted once no kept version reads them, and when a base is due."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from aisp.errors import StateError
from aisp.state.store import LmdbStateStore
from aisp.state.window_log import MIN_BASE_ROWS, WindowLog

MAP_SIZE = 1 << 24
Windows = dict[int, tuple[str, int, float]]  # serial -> (key, count, sum), in log order


def columns(windows: Windows) -> dict[str, npt.NDArray[Any]]:
    return {
        "__uid": np.array(list(windows), dtype=np.int64),
        "key": np.array([w[0] for w in windows.values()], dtype=str),
        "count": np.array([w[1] for w in windows.values()], dtype=np.int64),
        "sum": np.array([w[2] for w in windows.values()], dtype=np.float64),
    }


def as_windows(read: dict[str, npt.NDArray[Any]] | None) -> list[tuple[int, str, int, float]]:
    assert read is not None and sorted(read) == ["__uid", "count", "key", "sum"]
    return list(
        zip(
            read["__uid"].tolist(),
            read["key"].tolist(),
            read["count"].tolist(),
            read["sum"].tolist(),
            strict=True,
        )
    )


def rows(windows: Windows) -> list[tuple[int, str, int, float]]:
    return [(uid, *w) for uid, w in windows.items()]


@st.composite
def checkpoints(draw: st.DrawFn, count: int) -> list[tuple[bool, Windows, list[int], int]]:
    """Each checkpoint: a base or not, the windows that changed (or the whole state of a base),
    the serials of windows that closed (not for a base), how far the oldest kept one moves on.
    Serials are never reused; a window may open and close between two checkpoints."""
    out = []
    open_now: list[int] = []
    serial = 0
    for i in range(count):
        base = i == 0 or draw(st.booleans())
        updated = draw(st.lists(st.sampled_from(open_now), unique=True)) if open_now else []
        fresh = list(range(serial, serial + draw(st.integers(0, 4))))
        serial += len(fresh)
        closing = draw(st.lists(st.sampled_from(open_now + fresh), unique=True)) if open_now + fresh else []
        changed = draw(st.permutations(updated + fresh))
        windows = {
            uid: (draw(st.sampled_from(["a", "bb", "ccc"])), draw(st.integers(0, 99)), draw(st.floats(-9, 9)))
            for uid in changed
        }
        open_now = [uid for uid in open_now + fresh if uid not in closing]
        if base:  # the whole state: what stays open, in an order of its own
            open_now = draw(st.permutations(open_now))
            windows = {uid: windows.get(uid, ("base", uid, 0.5)) for uid in open_now}
            closing = []
        out.append((base, windows, closing, draw(st.integers(0, 2))))
    return out


class Model:
    """The open windows at each version: a base replaces them, a change moves each changed
    window to the end (the order a restore gives: by each window's newest row), closes remove."""

    def __init__(self) -> None:
        self.state: Windows = {}
        self.at: dict[int, Windows] = {}

    def apply(self, version: int, base: bool, windows: Windows, gone: list[int]) -> None:
        if base:
            self.state = dict(windows)
        else:
            for uid, w in windows.items():
                self.state.pop(uid, None)
                self.state[uid] = w
            for uid in gone:
                self.state.pop(uid, None)
        self.at[version] = dict(self.state)


def write(
    log: WindowLog, model: Model, version: int, step: tuple[bool, Windows, list[int], int], before: int
) -> None:
    base, windows, gone, _ = step
    log.write(version, "w", columns(windows), np.array(gone, dtype=np.int64), base=base, before=before)
    model.apply(version, base, windows, gone)


@settings(max_examples=30, deadline=None)
@given(st.integers(1, 8).flatmap(lambda n: st.tuples(checkpoints(n), checkpoints(3))), st.data())
def test_a_restore_reads_the_windows_of_any_kept_version(
    tmp_path_factory: pytest.TempPathFactory,
    runs: tuple[list[tuple[bool, Windows, list[int], int]], list[tuple[bool, Windows, list[int], int]]],
    data: st.DataObject,
) -> None:
    first, then = runs
    path = tmp_path_factory.mktemp("windows")
    store = LmdbStateStore(path, map_size=MAP_SIZE)
    log, model = WindowLog(store), Model()
    kept = 0  # the oldest version a restore may ask for (0: all)
    try:
        for version, step in enumerate(first, start=1):
            kept = min(kept + step[3], version)
            write(log, model, version, step, kept)
            for at in range(max(kept, 1), version + 1):  # every kept version reads back exactly
                assert as_windows(log.read(at, "w")) == rows(model.at[at])
        store.close()  # a restart: a new store and log over the same files
        store = LmdbStateStore(path, map_size=MAP_SIZE)
        log = WindowLog(store)
        assert log.base_due("w", 0)  # the first write of a process: a base
        at = data.draw(st.integers(max(kept, 1), len(first)), label="restore from")
        assert as_windows(log.read(at, "w")) == rows(model.at[at])
        assert log.read(at, "other") is None
        store.discard_after(at)  # the timeline after ``at`` is abandoned
        model.state = dict(model.at[at])
        kept = at
        for version, step in enumerate(then, start=at + 1):
            kept = min(kept + step[3], version)
            write(log, model, version, step, kept)
        for version in range(kept, at + len(then) + 1):
            assert as_windows(log.read(version, "w")) == rows(model.at[version])
    finally:
        store.close()


def entries(store: LmdbStateStore) -> list[tuple[int, str]]:
    """(version, kind) of every entry of step ``w`` still in the store."""
    prefix = b"w\x1ewindows\x1f"
    return [
        (int.from_bytes(name[len(prefix) : -1], "big"), name[-1:].decode())
        for name, _ in store.read(2**62, prefix)
    ]


def test_entries_no_kept_version_reads_are_deleted(tmp_path: Path) -> None:
    store = LmdbStateStore(tmp_path, map_size=MAP_SIZE)
    log = WindowLog(store)
    one: Windows = {1: ("a", 1, 1.0)}
    none = np.array([], dtype=np.int64)
    try:
        log.write(1, "w", columns(one), none, base=True)
        log.write(2, "w", columns({2: ("b", 1, 2.0)}), np.array([1]), base=False)
        log.write(3, "w", columns({2: ("b", 2, 3.0)}), none, base=True, before=1)
        assert entries(store) == [(1, "B"), (2, "G"), (2, "R"), (3, "B")]  # 1 is still kept
        log.write(4, "w", columns({3: ("c", 1, 4.0)}), none, base=False, before=3)
        assert entries(store) == [(3, "B"), (4, "G"), (4, "R")]  # every kept version reads from 3
        assert log.read(2, "w") is None  # its base is gone
        assert as_windows(log.read(4, "w")) == [(2, "b", 2, 3.0), (3, "c", 1, 4.0)]
        log.write(5, "w", columns({}), np.array([2, 3]), base=False, before=4)
        assert entries(store) == [(3, "B"), (4, "G"), (4, "R"), (5, "G"), (5, "R")]  # no newer base
        assert as_windows(log.read(5, "w")) == []
    finally:
        store.close()


def test_steps_are_logged_apart(tmp_path: Path) -> None:
    store = LmdbStateStore(tmp_path, map_size=MAP_SIZE)
    log = WindowLog(store)
    none = np.array([], dtype=np.int64)
    try:
        log.write(1, "w", columns({1: ("a", 1, 1.0)}), none, base=True)
        log.write(1, "w2", columns({7: ("z", 7, 7.0)}), none, base=True)
        log.write(2, "w2", columns({8: ("y", 8, 8.0)}), none, base=True, before=2)  # deletes w2's 1 only
        assert as_windows(log.read(2, "w")) == [(1, "a", 1, 1.0)]
        assert as_windows(log.read(2, "w2")) == [(8, "y", 8, 8.0)]
        assert entries(store) == [(1, "B")]
        assert log.read(0, "w") is None and log.read(9, "w3") is None
    finally:
        store.close()


def test_changes_without_a_base_are_an_error(tmp_path: Path) -> None:
    store = LmdbStateStore(tmp_path, map_size=MAP_SIZE)
    log = WindowLog(store)
    try:
        log.write(1, "w", columns({1: ("a", 1, 1.0)}), np.array([], dtype=np.int64), base=False)
        with pytest.raises(StateError, match="^the state store has changes of window step 'w' but no base$"):
            log.read(1, "w")
    finally:
        store.close()


def test_a_base_is_due_once_the_log_outgrows_the_state() -> None:
    log = WindowLog(None)  # type: ignore[arg-type]  # base_due reads no store
    assert log.base_due("w", 0) and log.base_due("w", 10**9)  # nothing written in this process

    class Stub:
        def write(self, *args: Any) -> None: ...

        def delete_range(self, *args: Any) -> int:
            return 0

    log = WindowLog(Stub())  # type: ignore[arg-type]
    log.write(1, "w", {"__uid": np.arange(3)}, np.array([], dtype=np.int64), base=True)
    assert not log.base_due("w", 0)
    log.write(2, "w", {"__uid": np.arange(MIN_BASE_ROWS - 1)}, np.array([5]), base=False)
    assert not log.base_due("w", 0)  # rows + closed windows logged: MIN_BASE_ROWS, not more
    log.write(3, "w", {"__uid": np.arange(0)}, np.array([6]), base=False)
    assert log.base_due("w", 0) and log.base_due("w", MIN_BASE_ROWS)
    assert not log.base_due("w", MIN_BASE_ROWS + 1)  # more windows open than logged
    assert log.base_due("other", MIN_BASE_ROWS + 1)
    log.write(4, "w", {"__uid": np.arange(1)}, np.array([], dtype=np.int64), base=True)
    assert not log.base_due("w", 0)
