"""`aisp run --checkpoint-dir`: a restart with a changed model file is refused, naming the step;
`--allow-model-change` restores and the summary says so."""

from __future__ import annotations

from pathlib import Path

from typer.testing import CliRunner

from aisp.cli import app
from tests.support.models import linear_model

ROOT = Path(__file__).resolve().parents[3]
FRAUD = ROOT / "examples" / "fraud" / "pipeline.py"


def test_a_restart_across_a_model_change_needs_the_option_and_is_reported(tmp_path: Path) -> None:
    model = linear_model(tmp_path / "m.onnx", 0.1)
    args = ["run", str(FRAUD), "--events", "2000", "--output", str(tmp_path / "out.jsonl"), "--no-live",
            "--param", f"model={model}", "--checkpoint-dir", str(tmp_path / "chk")]  # fmt: skip
    runner = CliRunner()
    assert runner.invoke(app, args).exit_code == 0
    linear_model(model, 0.2)  # other weights, the same version
    refused = runner.invoke(app, args)
    text = " ".join(refused.output.split())
    assert refused.exit_code == 2 and "model step 'score' was checkpointed" in text, refused.output
    allowed = runner.invoke(app, [*args, "--allow-model-change"])
    text = " ".join(allowed.output.split())
    assert allowed.exit_code == 0 and "restored across a model change: step 'score' was version 1" in text
    assert runner.invoke(app, ["run", str(FRAUD), "--allow-model-change", "--events", "10"]).exit_code == 2
