"""Bearer tokens by scope: any header, any token set; the config file and the environment."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from aisp.errors import ConfigError
from aisp.serve.auth import Tokens, api_key

TOKEN = st.text(st.characters(min_codepoint=33, max_codepoint=126), min_size=1, max_size=20)


@given(st.sets(TOKEN, max_size=3), st.sets(TOKEN, max_size=3), st.one_of(st.none(), st.text(max_size=40)))
def test_every_header_gets_200_401_or_403_as_its_token_and_scope_say(
    users: set[str], admins: set[str], header: str | None
) -> None:
    tokens = Tokens.of(tokens=users, admin_tokens=admins)
    for scope in ("infer", "admin"):
        status = tokens.check(header, scope)
        if not (users or admins):
            assert status == 200  # no token configured: auth is off
            continue
        token = header[7:].strip() if header and header.startswith("Bearer ") else None
        if token in admins:
            assert status == 200
        elif token in users:
            assert status == (200 if scope == "infer" else 403)
        else:
            assert status == 401


def test_tokens_come_from_the_config_file_and_the_environment(tmp_path: Path) -> None:
    config = tmp_path / "aisp.toml"
    config.write_text('[auth]\ntokens = ["from-file"]\nadmin_tokens = ["root-file"]\n')
    tokens = Tokens.load(config, {"AISP_TOKENS": " from-env , ", "AISP_ADMIN_TOKENS": "root-env"})
    assert [
        tokens.check(f"Bearer {t}", "admin") for t in ("from-file", "from-env", "root-file", "root-env")
    ] == [
        403,
        403,
        200,
        200,
    ]
    assert tokens.check("Bearer ", "infer") == 401  # an empty token is never one
    assert not Tokens.load(None, {}).enabled


def test_an_unreadable_config_is_a_clear_error(tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text("[auth\n")
    with pytest.raises(ConfigError, match="cannot read config"):
        Tokens.load(bad, {})
    with pytest.raises(ConfigError, match="cannot read config"):
        Tokens.load(tmp_path / "missing.toml", {})


@given(TOKEN, st.ip_addresses().map(str))
def test_a_rate_limit_counts_against_the_token_never_its_text(token: str, peer: str) -> None:
    key = api_key(f"Bearer {token}", peer)
    assert key == api_key(f"Bearer {token}", "another peer") and len(key) == 16
    # a digest, not the text: a token of a few hex characters may turn up in it by chance
    assert token not in key or len(token) < 6
    assert api_key(None, peer) == peer and api_key(f"Basic {token}", peer) == peer
