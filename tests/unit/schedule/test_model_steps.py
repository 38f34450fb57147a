"""A checkpoint records each model step's version and weights hash; a restart with another model
is refused unless the run allows it (then the summary and the log name the change)."""

from __future__ import annotations

import logging
import random
from pathlib import Path
from typing import Any

import msgspec
import pytest

from aisp import CheckpointOptions, RunOptions, RunSummary, run
from aisp.cli.common import load_pipeline
from aisp.infer.runtimes.base import OnnxRuntime, file_sha256
from aisp.schedule.model_steps import ModelChanged
from aisp.state.checkpoint import CheckpointStore
from tests.support.models import FRAUD_CONFIG, fraud_repository, linear_model

ROOT = Path(__file__).resolve().parents[3]
FRAUD = ROOT / "examples" / "fraud" / "pipeline.py"


def fraud_run(checkpoints: Path, *, allow: bool = False, **model: Any) -> RunSummary:
    """Workload F over 3000 generated events with the given model, checkpointing in ``checkpoints``."""
    pipeline = load_pipeline(str(FRAUD), events=3000, seed=3, **model)
    ck = CheckpointOptions(dir=str(checkpoints), allow_model_change=allow)
    return run(pipeline, RunOptions(checkpoints=ck, tune_gc=False, repository_poll_s=0))


def recorded(checkpoints: Path) -> dict[str, Any]:
    store = CheckpointStore(checkpoints)
    return dict(store.meta(store.ids()[-1])["models"])


def test_a_checkpoint_records_the_models_version_and_weights_hash(tmp_path: Path) -> None:
    model = linear_model(tmp_path / "m.onnx", 0.1)
    fraud_run(tmp_path / "chk", model=model)
    assert recorded(tmp_path / "chk") == {"score": {"version": "1", "weights_sha256": file_sha256(model)}}
    assert OnnxRuntime(model).weights_sha256 == file_sha256(model)


def test_a_restart_with_the_same_model_restores(tmp_path: Path) -> None:
    model = linear_model(tmp_path / "m.onnx", 0.1)
    first = fraud_run(tmp_path / "chk", model=model)
    again = fraud_run(tmp_path / "chk", model=model)
    assert again.restored_from is not None and again.restored_from >= first.checkpoints
    assert again.model_changes == {}


@pytest.mark.parametrize("seed", [random.randrange(1 << 30) for _ in range(3)])
def test_a_changed_model_file_of_the_same_version_is_refused_by_name_and_hashes(
    tmp_path: Path, seed: int
) -> None:
    rng = random.Random(seed)
    print(f"seed={seed}")
    before, after = rng.sample([x / 100 for x in range(1, 100)], 2)  # two different weights
    model = linear_model(tmp_path / "m.onnx", before)
    fraud_run(tmp_path / "chk", model=model)
    old = file_sha256(model)
    linear_model(model, after)  # the same path and version, other weights
    new = file_sha256(model)
    with pytest.raises(ModelChanged) as caught:
        fraud_run(tmp_path / "chk", model=model)
    message = str(caught.value)
    assert "'score'" in message and old in message and new in message and "--allow-model-change" in message
    assert "version 1" in message


def test_with_the_option_it_restores_and_the_summary_and_log_say_so(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    model = linear_model(tmp_path / "m.onnx", 0.1)
    fraud_run(tmp_path / "chk", model=model)
    old = file_sha256(model)
    linear_model(model, 0.2)
    with caplog.at_level(logging.WARNING, logger="aisp.checkpoint"):
        summary = fraud_run(tmp_path / "chk", allow=True, model=model)
    assert summary.restored_from is not None
    assert summary.model_changes == {
        "score": {
            "checkpoint": {"version": "1", "weights_sha256": old},
            "now": {"version": "1", "weights_sha256": file_sha256(model)},
        }
    }
    assert "model_changes" in msgspec.json.decode(summary.to_json())
    assert any(
        "across a model change" in r.getMessage() and "'score'" in r.getMessage() for r in caplog.records
    )
    assert recorded(tmp_path / "chk")["score"]["weights_sha256"] == file_sha256(model)  # the new one now


def test_an_old_checkpoint_without_hashes_restores_checking_the_version_only(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    model = linear_model(tmp_path / "m.onnx", 0.1)
    fraud_run(tmp_path / "chk", model=model)
    store = CheckpointStore(tmp_path / "chk")
    for checkpoint_id in store.ids():  # as written before weights were hashed: the version alone
        manifest = store.root / f"chk-{checkpoint_id:010d}" / "manifest.json"
        data = msgspec.json.decode(manifest.read_bytes())
        data["meta"]["models"] = {"score": "1"}
        manifest.write_bytes(msgspec.json.encode(data))
    linear_model(model, 0.3)  # not detectable without a recorded hash
    with caplog.at_level(logging.INFO, logger="aisp.checkpoint"):
        summary = fraud_run(tmp_path / "chk", model=model)
    assert summary.restored_from is not None and summary.model_changes == {}
    assert any("no weights hash" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("newest", [1, 2], ids=["policy: newest only", "policy: newest two"])
def test_a_repository_model_serves_the_checkpoints_version_while_its_policy_allows_it(
    tmp_path: Path, newest: int
) -> None:
    config = FRAUD_CONFIG.replace("num_versions: 1", f"num_versions: {newest}")
    repo = fraud_repository(tmp_path / "repo", {1: 0.1}, config)
    fraud_run(tmp_path / "chk", model_repository=repo)
    assert recorded(tmp_path / "chk")["score"]["version"] == "1"
    fraud_repository(repo, {2: 0.2}, config)  # a newer version arrived while the run was down
    if newest == 2:  # version 1 may still serve: it does, and the state resumes with it
        assert fraud_run(tmp_path / "chk", model_repository=repo).model_changes == {}
        assert recorded(tmp_path / "chk")["score"]["version"] == "1"
        return
    with pytest.raises(ModelChanged, match=r"'score'.*version 1.*version 2"):
        fraud_run(tmp_path / "chk", model_repository=repo)
    changed = fraud_run(tmp_path / "chk", allow=True, model_repository=repo).model_changes
    assert changed["score"]["checkpoint"]["version"] == "1" and changed["score"]["now"]["version"] == "2"


def test_worker_processes_record_and_check_the_models_too(tmp_path: Path) -> None:
    from aisp.cli.common import _bind
    from aisp.schedule.executor import ExecutorOptions
    from benchmarks.workload import write_events

    events = tmp_path / "events.jsonl"
    write_events(events, 3000, seed=2)
    model = linear_model(tmp_path / "m.onnx", 0.1)

    def workers_run(allow: bool = False) -> RunSummary:
        p = load_pipeline(str(FRAUD), model=model)
        _bind(p, str(events), str(tmp_path / "out.jsonl"))
        ck = CheckpointOptions(dir=str(tmp_path / "chk"), allow_model_change=allow)
        return run(p, RunOptions(checkpoints=ck, execution=ExecutorOptions(workers=2), tune_gc=False))

    workers_run()
    assert recorded(tmp_path / "chk") == {"score": {"version": "1", "weights_sha256": file_sha256(model)}}
    linear_model(model, 0.5)
    with pytest.raises(ModelChanged, match="'score'"):
        workers_run()
    assert set(workers_run(allow=True).model_changes) == {"score"}
