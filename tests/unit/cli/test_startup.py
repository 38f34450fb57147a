"""`aisp run` imports only what the run needs: a pipeline that neither traces, serves, calls a
remote model nor reads a model repository loads no OpenTelemetry, gRPC, tritonclient or
pydantic (together about a second of start-up)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]

CHECK = """
import sys
sys.argv = ["aisp", "run", sys.argv[1], "--events", "300", "--output", "null:", "--no-live"]
from aisp.cli import main
try:
    main()
except SystemExit as exc:
    assert not exc.code, exc.code
heavy = ("opentelemetry", "grpc", "tritonclient", "pydantic", "google.protobuf")
print(sorted(m for m in heavy if m in sys.modules))
"""


def test_a_plain_run_imports_no_tracing_serving_or_protocol_libraries() -> None:
    pipeline = ROOT / "examples" / "fraud" / "pipeline.py"
    res = subprocess.run(
        [sys.executable, "-c", CHECK, str(pipeline)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env={"PYTHONPATH": str(ROOT / "src"), "PATH": "/usr/bin:/bin"},
    )
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.strip().splitlines()[-1] == "[]", res.stdout
