"""`aisp serve --allow-model-control` on an address other machines reach needs admin tokens: model
control loads models and runs pipeline files at a client's request."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from aisp.cli import app
from aisp.cli.common import check_model_control
from aisp.errors import ConfigError
from aisp.serve.auth import Tokens, is_loopback

ROOT = Path(__file__).resolve().parents[3]
PIPELINE = ROOT / "examples" / "fraud" / "pipeline.py"
NONE = Tokens.of()
USERS_ONLY = Tokens.of(tokens=["user"])
ADMIN = Tokens.of(admin_tokens=["root"])


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "10.1.2.3", "192.168.0.7", "2001:db8::1"])
@pytest.mark.parametrize("tokens", [NONE, USERS_ONLY], ids=["no tokens", "user tokens only"])
def test_model_control_on_a_reachable_address_without_admin_tokens_is_refused(
    host: str, tokens: Tokens
) -> None:
    with pytest.raises(ConfigError, match="needs admin tokens"):
        check_model_control(host, True, tokens)
    check_model_control(host, True, ADMIN)  # admin tokens: allowed
    check_model_control(host, False, NONE)  # no model control: nothing to guard


@pytest.mark.parametrize("host", ["127.0.0.1", "127.0.0.2", "::1", "localhost"])
def test_model_control_on_loopback_needs_no_tokens(host: str) -> None:
    assert is_loopback(host)
    check_model_control(host, True, NONE)


def test_aisp_serve_refuses_to_start_before_loading_anything(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("AISP_TOKENS", "AISP_ADMIN_TOKENS"):
        monkeypatch.delenv(name, raising=False)
    args = ["serve", str(PIPELINE), "--host", "0.0.0.0", "--allow-model-control", "--http-port", "0"]
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 2, res.output
    assert "--allow-model-control on 0.0.0.0 (not a loopback address) needs admin tokens" in " ".join(
        res.output.split()
    )
