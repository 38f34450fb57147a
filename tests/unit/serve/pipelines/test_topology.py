"""Topology updates from pipeline files: only files inside the served pipeline's directory (or a
``--pipeline-dir``) are loaded; a file that fails to load, in any way, is a 400 with the reason
and the running graph keeps answering."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from starlette.testclient import TestClient

from aisp.cli.common import _reloader
from aisp.errors import Forbidden
from aisp.serve.http.app import create_app
from aisp.serve.pipelines.service import PipelineService
from aisp.serve.pipelines.topology import allowed_file

PIPELINE = """
import msgspec
from aisp import Pipeline, WorkloadFSource, CollectSink

class Ev(msgspec.Struct):
    id: int
    x: float

def build(**_):
    p = Pipeline("doubling", output_columns=["id", "y"])
    src = p.source("events", WorkloadFSource(events=1), schema=Ev)
    src.map_batch("scale", lambda b: b.with_columns({{"y": b.numpy("x") * {factor}}})).sink(
        "out", CollectSink(columns=["id", "y"])
    )
    return p
"""


def marking(marker: Path) -> str:
    """A pipeline file whose import leaves ``marker`` behind (the side effect a refusal prevents)."""
    return f"from pathlib import Path\nPath({str(marker)!r}).write_text('ran')\n" + PIPELINE.format(factor=3)


@pytest.fixture
def served(tmp_path: Path) -> Iterator[tuple[TestClient, PipelineService, Path]]:
    home = tmp_path / "served"
    home.mkdir()
    target = home / "pipeline.py"
    target.write_text(PIPELINE.format(factor=2))
    extra = tmp_path / "extra"
    extra.mkdir()
    reload = _reloader(str(target), {})
    service = PipelineService(reload(None), chunk_rows=64)
    service.reload = reload
    service.pipeline_dirs = (str(home), str(extra))
    service.start()
    try:
        with TestClient(create_app(None, pipelines={service.name: service}, model_control=True)) as client:
            yield client, service, tmp_path
    finally:
        assert service.close()


def answers(client: TestClient, x: float) -> list[dict[str, object]]:
    r = client.post("/v1/pipelines/doubling/events", content=json.dumps({"id": 1, "x": x}).encode())
    assert r.status_code == 200, r.text
    return [json.loads(line) for line in r.content.splitlines()]


def update(client: TestClient, path: str) -> tuple[int, dict[str, object]]:
    r = client.post("/v1/pipelines/doubling/graph", json={"path": path})
    return r.status_code, r.json()


def escaping_paths(tmp: Path, evil: Path) -> dict[str, str]:
    """Ways to name a file outside the served directory, by path or through a symlink inside it."""
    home = tmp / "served"
    (home / "sub").mkdir(exist_ok=True)
    (home / "link.py").symlink_to(evil)
    (home / "outdir").symlink_to(evil.parent, target_is_directory=True)
    return {
        "absolute": str(evil),
        "dotdot": f"{home}/../outside/evil.py",
        "dotdot-deep": f"{home}/sub/./../../outside/evil.py",
        "relative": os.path.relpath(evil),
        "symlinked-file": str(home / "link.py"),
        "symlinked-dir": str(home / "outdir" / "evil.py"),
        "prefix-sibling": str(tmp / "served-evil.py"),  # /x/served-evil.py is not inside /x/served
    }


KINDS = ["absolute", "dotdot", "dotdot-deep", "relative", "symlinked-file", "symlinked-dir", "prefix-sibling"]


@pytest.mark.parametrize("kind", KINDS)
def test_a_file_outside_the_allowed_directories_is_refused_and_never_runs(
    served: tuple[TestClient, PipelineService, Path], kind: str
) -> None:
    client, service, tmp = served
    marker = tmp / "marker"
    evil = tmp / "outside" / "evil.py"
    evil.parent.mkdir()
    evil.write_text(marking(marker))
    (tmp / "served-evil.py").write_text(marking(marker))
    path = escaping_paths(tmp, evil)[kind]
    status, body = update(client, path)
    assert status == 403 and "outside the directories" in str(body["error"]), body
    assert not marker.exists()  # the file's code never ran
    assert service.graph_version == 1 and answers(client, 1.5) == [{"id": 1, "y": 3.0}]


def test_files_in_the_served_directory_and_a_pipeline_dir_load(
    served: tuple[TestClient, PipelineService, Path],
) -> None:
    client, service, tmp = served
    (tmp / "served" / "v2.py").write_text(PIPELINE.format(factor=3))
    (tmp / "extra" / "v3.py").write_text(PIPELINE.format(factor=4))
    assert update(client, str(tmp / "served" / "v2.py"))[0] == 200
    assert answers(client, 1.0) == [{"id": 1, "y": 3.0}]
    assert update(client, f"{tmp}/served/../extra/v3.py")[0] == 200  # '..' that stays inside: fine
    assert answers(client, 1.0) == [{"id": 1, "y": 4.0}] and service.graph_version == 3
    status, body = update(client, str(tmp / "served" / "missing.py"))
    assert status == 400 and "no pipeline file" in str(body["error"])


FAILURES = {
    "SystemExit": "raise SystemExit(3)",
    "SystemExit-none": "import sys\nsys.exit()",
    "exception": "raise RuntimeError('no such luck')",
    "syntax error": "def build(:\n    pass",
    "import error": "import aisp_no_such_module",
    "BaseException": "class Odd(BaseException):\n    pass\nraise Odd('odd')",
    "build raises SystemExit": "def build(**_):\n    raise SystemExit('from build')",
    "no pipeline": "pipeline = 42",
}


@pytest.mark.parametrize("kind", sorted(FAILURES))
def test_a_file_that_fails_to_load_in_any_way_is_a_400_and_the_graph_stays(
    served: tuple[TestClient, PipelineService, Path], kind: str
) -> None:
    client, service, tmp = served
    broken = tmp / "served" / "broken.py"
    broken.write_text(FAILURES[kind] + "\n")
    status, body = update(client, str(broken))
    assert status == 400, body
    assert "the running graph stays" in str(body["error"])
    assert service.graph_version == 1 and answers(client, 2.0) == [{"id": 1, "y": 4.0}]
    assert service.updates[-1]["failed"]
    assert client.get("/v1/pipelines/doubling/graph").json()["version"] == 1


@settings(max_examples=200, deadline=None)
@given(st.lists(st.sampled_from(["a", "b", "..", "."]), min_size=1, max_size=8))
def test_a_path_is_allowed_exactly_when_it_normalises_inside_the_directory(parts: list[str]) -> None:
    root = "/nonexistent-root/served"  # no symlinks here: resolving is normalising
    path = "/".join([root, *parts])
    inside = os.path.normpath(path) == root or os.path.normpath(path).startswith(root + "/")
    try:
        allowed_file(path, [root])
        allowed = True
    except Forbidden:
        allowed = False
    assert allowed == inside, path
