"""A served fraud pipeline gets a new topology under continuous load (an added filter step and a
changed output step; the keyed ``user_stats`` step kept): every event is answered once, and the
running count and mean per user continue from the old graph's state, equal to an uninterrupted
run. A failed update leaves the running graph serving."""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

import httpx
import pytest

from benchmarks.workload import reference_outputs, write_events
from tests.support.serving import aisp_serve, wait_http

ROOT = Path(__file__).resolve().parents[2]
PIPELINE = ROOT / "examples" / "fraud" / "pipeline.py"
MODEL = ROOT / "examples" / "fraud" / "model.onnx"

NEW_VERSION = f'''
"""Version 2 of the fraud pipeline: a filter after the running statistics, another output step."""
import importlib.util
import sys

from aisp import Batch, NullSink, OnnxRuntime, Pipeline, WorkloadFSource

spec = importlib.util.spec_from_file_location("fraud_v1", {str(PIPELINE)!r})
v1 = sys.modules["fraud_v1"] = importlib.util.module_from_spec(spec)
spec.loader.exec_module(v1)
COLUMNS = [*v1.OUTPUT_COLUMNS, "large"]


def emit(batch: Batch) -> Batch:
    out = v1.emitter(v1.OUTPUT_COLUMNS)(batch)
    return out.with_columns({{"large": batch.numpy("amount") > 500.0}})


def build(events: int = 1_000_000, seed: int = 0) -> Pipeline:
    p = Pipeline("fraud", output_columns=COLUMNS)
    src = p.source("events", WorkloadFSource(events=events, seed=seed), schema=v1.Event)
    stats = src.key_by("by_user", "user").running_stats("user_stats", "amount", count="n", mean="mean_amount")
    kept = stats.filter("plausible", lambda b: b.numpy("amount") < 1e9)
    scored = kept.map_batch("features", v1.features).infer(
        "score", OnnxRuntime({str(MODEL)!r}, name="fraud"),
        inputs={{"features": "features"}}, outputs={{"score": "score"}},
    )
    scored.map_batch("emit_v2", emit).sink("out", NullSink())
    return p
'''

BROKEN_VERSION = """
from aisp import Pipeline

def build(**_):
    raise RuntimeError("this version does not build")
"""


def test_a_new_topology_under_load_continues_the_keyed_state_and_answers_every_event_once(
    tmp_path: Path,
) -> None:
    events = tmp_path / "events.jsonl"
    write_events(events, 4000, seed=5)
    lines = events.read_bytes().splitlines()
    expected = reference_outputs(events, MODEL)
    v2 = tmp_path / "fraud_v2.py"
    v2.write_text(NEW_VERSION)
    broken = tmp_path / "fraud_broken.py"
    broken.write_text(BROKEN_VERSION)
    allowed = ("--allow-model-control", "--pipeline-dir", str(tmp_path))  # new versions live there
    with aisp_serve(PIPELINE, http=True, grpc=False, extra_args=allowed) as (addresses, _):
        wait_http(addresses["http"])
        base = f"http://{addresses['http']}"
        answers: list[dict[str, Any]] = []
        reports: list[httpx.Response] = []
        sent = threading.Event()

        def update_midway() -> None:
            sent.wait(60)
            with httpx.Client(base_url=base, timeout=60) as admin:
                reports.append(admin.post("/v1/pipelines/fraud/graph", json={"path": str(broken)}))
                reports.append(admin.post("/v1/pipelines/fraud/graph", json={"path": str(v2)}))

        updater = threading.Thread(target=update_midway)
        updater.start()
        with httpx.Client(base_url=base, timeout=60) as client:
            for i in range(0, len(lines), 50):  # continuous load: chunk after chunk
                chunk = lines[i : i + 50]
                r = client.post("/v1/pipelines/fraud/events", content=b"\n".join(chunk))
                assert r.status_code == 200, r.text
                answers += [json.loads(x) for x in r.content.splitlines()]
                if i >= 1000:
                    sent.set()
        updater.join()
        status = httpx.get(f"{base}/v1/pipelines/fraud/graph").json()
        metrics = httpx.get(f"{base}/metrics").text
        dashboard = httpx.get(f"{base}/dashboard/state").json()
    assert dashboard["graph_version"] == 2 and dashboard["graph_updates"][-1]["carried"] == ["user_stats"]
    assert "plausible" in [n["id"] for n in dashboard["graph"]["nodes"]]
    assert 'aisp_pipeline_graph_version{pipeline="fraud"} 2.0' in metrics
    assert 'aisp_pipeline_graph_updates_total{outcome="failed",pipeline="fraud"} 1.0' in metrics

    failed, applied = reports
    assert failed.status_code == 400 and "RuntimeError: this version does not build" in failed.json()["error"]
    assert applied.status_code == 200, applied.text
    report = applied.json()
    assert report["version"] == 2 and report["carried"] == ["user_stats"] and report["dropped"] == []
    assert "plausible" in report["steps"] and "emit_v2" in report["steps"] and "emit" not in report["steps"]
    assert status["version"] == 2 and [u.get("failed", "") != "" for u in status["updates"]] == [True, False]

    results = [a for a in answers if "id" in a]
    assert len(answers) == len(lines)  # one answer per line: events and bad lines alike
    assert [a["id"] for a in results] == sorted(expected)  # each event once, in order
    switched = [a for a in results if "large" in a]
    assert switched and switched[-1]["id"] == results[-1]["id"]  # the new output step answers at the end
    assert not any("large" in a for a in results[: len(results) - len(switched)])  # and only after the switch
    for a in results:  # the keyed state continued: equal to an uninterrupted run
        e = expected[a["id"]]
        assert (a["user"], a["n"], a["mean_amount"]) == (e["user"], e["n"], e["mean_amount"]), a
        assert abs(a["score"] - e["score"]) <= 1e-5
    assert all(isinstance(a["large"], bool) for a in switched)


@pytest.mark.parametrize(
    ("body", "status", "message"),
    [
        ({"path": str(PIPELINE.parent / "nonexistent.py")}, 400, "no pipeline file"),
        ({"path": "/nonexistent/pipeline.py"}, 403, "outside the directories updates may load from"),
        ({"colour": "blue"}, 400, "must be"),
    ],
)
def test_topology_updates_that_cannot_work_get_clear_errors(
    body: dict[str, Any], status: int, message: str
) -> None:
    with aisp_serve(PIPELINE, http=True, grpc=False, extra_args=("--allow-model-control",)) as (addresses, _):
        wait_http(addresses["http"])
        r = httpx.post(f"http://{addresses['http']}/v1/pipelines/fraud/graph", json=body, timeout=60)
        assert r.status_code == status and message in r.json()["error"], r.text
        assert httpx.get(f"http://{addresses['http']}/v1/pipelines/fraud/graph").json()["version"] == 1
    with aisp_serve(PIPELINE, http=True, grpc=False) as (addresses, _):  # model control off
        wait_http(addresses["http"])
        r = httpx.post(f"http://{addresses['http']}/v1/pipelines/fraud/graph", timeout=60)
        assert r.status_code == 403


def test_a_new_version_of_a_pipeline_starts_from_the_old_ones_checkpoint(tmp_path: Path) -> None:
    """``aisp run NEW --from-savepoint DIR``: the new version (a filter step added, another output
    step) reads on where the old version's last checkpoint stopped, with its keyed state."""
    import subprocess
    import sys

    from tests.integration.test_exactly_once import ENV

    full = tmp_path / "events.jsonl"
    write_events(full, 6000, seed=9)
    lines = full.read_bytes().splitlines(keepends=True)
    first = tmp_path / "first.jsonl"
    first.write_bytes(b"".join(lines[:2500]))  # a prefix: the same byte positions as in ``full``
    v2 = tmp_path / "fraud_v2.py"
    v2.write_text(NEW_VERSION)

    def run(pipeline: Path, data: Path, out: Path, *extra: str) -> None:
        cmd = [sys.executable, "-m", "aisp.cli", "run", str(pipeline), "--input", str(data), "--output",
               str(out), "--dead-letter", str(out.with_suffix(".dl")), "--no-live", *extra]  # fmt: skip
        res = subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=300)
        assert res.returncode == 0, res.stderr[-3000:]

    run(PIPELINE, first, tmp_path / "v1.jsonl", "--checkpoint-dir", str(tmp_path / "v1-chk"))
    run(v2, full, tmp_path / "v2.jsonl", "--checkpoint-dir", str(tmp_path / "v2-chk"),
        "--from-savepoint", str(tmp_path / "v1-chk"))  # fmt: skip
    expected = reference_outputs(full, MODEL)
    v1_rows = [json.loads(x) for x in (tmp_path / "v1.jsonl").read_text().splitlines()]
    v2_rows = [json.loads(x) for x in (tmp_path / "v2.jsonl").read_text().splitlines()]
    assert v1_rows and v2_rows and all("large" in r for r in v2_rows)
    assert sorted(r["id"] for r in v1_rows + v2_rows) == sorted(expected)  # every event once
    for r in v2_rows:  # the state carried on: equal to one run over everything
        e = expected[r["id"]]
        assert (r["user"], r["n"], r["mean_amount"]) == (e["user"], e["n"], e["mean_amount"]), r
    again = subprocess.run(
        [sys.executable, "-m", "aisp.cli", "run", str(v2), "--input", str(full), "--output",
         str(tmp_path / "x.jsonl"), "--no-live", "--from-savepoint", str(tmp_path / "nowhere"),
         "--checkpoint-dir", str(tmp_path / "x-chk")],
        env=ENV, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert again.returncode != 0 and "no verified checkpoint" in again.stderr


def test_a_running_aisp_run_switches_to_the_new_version_on_sighup(tmp_path: Path) -> None:
    """``aisp run FILE --checkpoint-dir DIR``: SIGHUP after FILE changed switches the run to the
    new version at a checkpoint; every event is written once, the keyed state carries on, the
    events after the switch go through the new steps, and the dashboard shows the new graph."""
    import re
    import signal
    import subprocess
    import sys
    import time

    from tests.integration.test_exactly_once import ENV

    data = tmp_path / "events.jsonl"
    write_events(data, 10_000, seed=5)
    served = tmp_path / "fraud.py"  # a copy of the example, at a path of its own
    served.write_text(
        PIPELINE.read_text().replace("HERE = Path(__file__)", f"HERE = Path({str(PIPELINE)!r})")
    )
    out, log = tmp_path / "out.jsonl", tmp_path / "run.log"
    cmd = [sys.executable, "-m", "aisp.cli", "run", str(served), "--input", str(data), "--output", str(out),
           "--dead-letter", str(tmp_path / "dl.jsonl"), "--no-live", "--rate", "2500", "--dashboard",
           "--checkpoint-dir", str(tmp_path / "chk"),
           "--summary-json", str(tmp_path / "summary.json")]  # fmt: skip
    with log.open("w") as stderr:
        proc = subprocess.Popen(cmd, env=ENV, stdout=subprocess.DEVNULL, stderr=stderr)
    try:
        deadline = time.monotonic() + 60
        while not list((tmp_path / "chk").glob("chk-*/manifest.json")) and time.monotonic() < deadline:
            assert proc.poll() is None, log.read_text()
            time.sleep(0.05)
        served.write_text(NEW_VERSION)
        proc.send_signal(signal.SIGHUP)
        dashboard = re.search(r"^dashboard (\S+)", log.read_text(), re.M)
        assert dashboard is not None, log.read_text()
        state: dict[str, Any] = {}
        while state.get("graph_version") != 2 and time.monotonic() < deadline:
            state = httpx.get(dashboard.group(1) + "dashboard/state", timeout=10).json()
            time.sleep(0.1)
        assert "plausible" in [n["id"] for n in state["graph"]["nodes"]], state["graph"]
        assert state["graph_updates"][-1]["carried"] == ["user_stats"], state["graph_updates"]
        metrics = httpx.get(dashboard.group(1) + "metrics", timeout=10).text
        assert 'aisp_pipeline_graph_version{pipeline="fraud"} 2.0' in metrics
        assert 'aisp_pipeline_graph_updates_total{outcome="applied",pipeline="fraud"} 1.0' in metrics
        proc.wait(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 0, log.read_text()[-3000:]
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    expected = reference_outputs(data, MODEL)
    assert sorted(r["id"] for r in rows) == sorted(expected)  # every event once
    before, after = [r for r in rows if "large" not in r], [r for r in rows if "large" in r]
    assert before and after and max(r["id"] for r in before) < min(r["id"] for r in after), "one switch"
    for r in rows:  # the keyed state carried on through the switch
        e = expected[r["id"]]
        assert (r["user"], r["n"], r["mean_amount"]) == (e["user"], e["n"], e["mean_amount"]), r
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["restored_from"] is not None and summary["events_in"] == len(after)
