"""The windows example (`examples/windows/`) against its plain-Python reference: the same
windows with the same values and the same late events, whatever the batch size, and after
SIGKILLs and restarts from checkpoints (each window emitted once)."""

from __future__ import annotations

import importlib.util
import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.integration.test_exactly_once import ENV, kill_and_restart

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "windows"


def _events_module() -> Any:
    spec = importlib.util.spec_from_file_location("window_events_for_tests", EXAMPLE / "events.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


events = _events_module()


def aisp_run(data: Path, out: Path, *extra: str) -> list[str]:
    return [
        sys.executable, "-m", "aisp.cli", "run", str(EXAMPLE / "pipeline.py"), "--input", str(data),
        "--output", str(out), "--dead-letter", str(out.with_suffix(".dl")), "--no-live", *extra,
    ]  # fmt: skip


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]], list[int]]:
    """Held-out input (a seed the example's defaults do not use) with malformed lines."""
    path = tmp_path_factory.mktemp("windows") / "in.jsonl"
    lines = [json.dumps(e) for e in events.make_events(40_000, seed=7, users=40)]
    for at in (5, 777, 20_000):
        lines.insert(at, '{"id": 1, "user": "u1", "ts": "soon"')
    path.write_text("\n".join(lines) + "\n")
    rows, late = events.reference(events.read_events(path))
    assert len(late) > 100 and len(rows) > 1000  # the input exercises both
    return path, rows, late


def check(out: Path, rows: list[dict[str, Any]], late: list[int]) -> None:
    got = [json.loads(x) for x in out.read_text().splitlines()]
    key = lambda r: (r["user"], r["window_start"])  # noqa: E731
    assert len(got) == len({key(r) for r in got}), "a window was emitted twice"
    expected = {key(r): r for r in rows}
    assert {key(r) for r in got} == set(expected)
    for r in got:
        e = expected[key(r)]
        assert (r["window_end"], r["n"], r["max"]) == (e["window_end"], e["n"], e["max"])
        assert math.isclose(r["sum"], e["sum"], rel_tol=1e-12), (r, e)  # summed in another order
    dead = [json.loads(x) for x in out.with_suffix(".dl").read_text().splitlines()]
    late_dead = [d for d in dead if d["reason"] == "late"]
    assert sorted(d["row"]["id"] for d in late_dead) == sorted(late)
    for d in late_dead:
        start = d["row"]["ts"] - d["row"]["ts"] % events.SIZE_MS
        assert d["window"] == {"start": start, "end": start + events.SIZE_MS}
    assert sorted(d["line"] for d in dead if "line" in d) == [6, 778, 20_001]


@pytest.mark.parametrize("batch_rows", [1, 97, 4096])
def test_the_example_equals_the_reference_whatever_the_batch_size(
    tmp_path: Path, data: tuple[Path, list[dict[str, Any]], list[int]], batch_rows: int
) -> None:
    path, rows, late = data
    out = tmp_path / "out.jsonl"
    subprocess.run(
        aisp_run(path, out, "--batch-rows", str(batch_rows)), env=ENV, check=True, capture_output=True
    )
    check(out, rows, late)


@pytest.mark.parametrize("state", [[], ["--state-store"]], ids=["state-in-checkpoints", "state-store"])
def test_sigkill_and_restart_give_the_same_windows_once(
    tmp_path: Path, data: tuple[Path, list[dict[str, Any]], list[int]], state: list[str]
) -> None:
    path, rows, late = data
    out = tmp_path / "out.jsonl"
    cmd = aisp_run(
        path, out, "--checkpoint-dir", str(tmp_path / "chk"), "--checkpoint-interval-s", "0.2", *state
    )
    cmd += ["--rate", "12000"]  # about 3 s of input: most kills land mid-run
    assert kill_and_restart(cmd, kills=3, seed=4) >= 2
    check(out, rows, late)
