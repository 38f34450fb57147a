"""Credentials and TLS from a connector URL: where the password comes from (the URL, a variable, a
file; one of them), TLS settings that go together, and no secret in any error or repr."""

from __future__ import annotations

from pathlib import Path
from urllib.parse import quote

import pytest
from hypothesis import given
from hypothesis import strategies as st

from aisp.connectors.access import Access, SecuredOptions, access_of
from aisp.connectors.url import Address, mask, options
from aisp.errors import ConfigError

# (marked, so that no user name or host holds one by chance)
SECRETS = st.text(st.characters(min_codepoint=33, max_codepoint=0x2FF), min_size=1).map(lambda s: f"pw!{s}")


def resolve(url: str) -> Access:
    return access_of(url, Address.parse(url, 6379, "stream"), options(url, SecuredOptions))


@given(st.text(st.characters(min_codepoint=97, max_codepoint=122), min_size=1, max_size=8), SECRETS)
def test_a_password_in_the_url_is_read_back_exactly_and_never_shown(user: str, secret: str) -> None:
    url = f"redis://{user}:{quote(secret, safe='')}@h:1/s"
    access = resolve(url)
    assert (access.user, access.password, access.tls) == (user, secret, False)
    assert quote(secret, safe="") not in mask(url) and mask(url) == f"redis://{user}:***@h:1/s"
    assert secret not in repr(access) and secret not in repr(Address.parse(url, 6379, "stream"))
    with pytest.raises(ConfigError) as info:
        options(f"{url}?nope=1", SecuredOptions)
    assert quote(secret, safe="") not in str(info.value) and secret not in str(info.value)


def test_a_token_alone_is_masked_whole() -> None:
    assert mask("nats://s3cret-token@h:4222/S") == "nats://***@h:4222/S"
    assert mask("nats://h:4222/S?x=1") == "nats://h:4222/S?x=1"
    assert mask("/a/path@with/at") == "/a/path@with/at"


def test_the_password_comes_from_a_variable_or_a_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AISP_T_PW", "from-env")
    assert resolve("redis://u@h:1/s?password_env=AISP_T_PW").password == "from-env"
    secret = tmp_path / "pw"
    secret.write_text("from-file\n")  # what a vault agent writes: one trailing newline dropped
    assert resolve(f"redis://u@h:1/s?password_file={secret}").password == "from-file"
    with pytest.raises(ConfigError, match="comes from the URL and password_env: give one") as info:
        resolve("redis://u:inline-secret@h:1/s?password_env=AISP_T_PW")
    assert "inline-secret" not in str(info.value) and "from-env" not in str(info.value)
    with pytest.raises(ConfigError, match="AISP_T_UNSET: the variable is not set"):
        resolve("redis://u@h:1/s?password_env=AISP_T_UNSET")
    with pytest.raises(ConfigError, match="password_file=.*missing"):
        resolve(f"redis://u@h:1/s?password_file={tmp_path / 'missing'}")


def test_tls_settings_go_together(tmp_path: Path) -> None:
    ca, cert, key = (tmp_path / n for n in ("ca.pem", "c.pem", "c.key"))
    for f in (ca, cert, key):
        f.write_text("x")
    assert resolve(f"redis://h:1/s?tls=1&ca={ca}") == Access(tls=True, ca=str(ca))
    assert resolve(f"redis://h:1/s?ca={ca}").tls  # a CA alone means TLS
    full = resolve(f"redis://h:1/s?tls=yes&ca={ca}&cert={cert}&key={key}")
    assert (full.cert, full.key) == (str(cert), str(key))
    with pytest.raises(ConfigError, match="needs both cert= and key="):
        resolve(f"redis://h:1/s?tls=1&cert={cert}")
    with pytest.raises(ConfigError, match="but tls=0"):
        resolve(f"redis://h:1/s?tls=0&ca={ca}")
    with pytest.raises(ConfigError, match="ca=.*nope.pem: no such file"):
        resolve(f"redis://h:1/s?tls=1&ca={tmp_path / 'nope.pem'}")
    plain = Address.parse("rediss://h:1/s", 6379, "stream")
    assert access_of("rediss://h:1/s", plain, options("rediss://h:1/s", SecuredOptions), tls=True).tls


def test_the_tools_reach_a_broker_by_any_of_its_urls(tmp_path: Path) -> None:
    """An input's or an output's URL, whatever else it says: only its access options count."""
    from aisp.connectors.access import access_options

    ca = tmp_path / "ca.pem"
    ca.write_text("x")
    url = f"redis://u:pw@h:1/s?group=g&idle_stop_s=2&ca={ca}&dedupe_ttl_s=5"
    opts = access_options(url, SecuredOptions)
    assert access_of(url, Address.parse(url, 6379, "stream"), opts) == Access("u", "pw", tls=True, ca=str(ca))


@pytest.mark.parametrize(
    "url",
    [
        "redis://app:{s}@127.0.0.1:1/st", "rediss://:{s}@127.0.0.1:1/st", "nats://app:{s}@127.0.0.1:1/ST",
        "nats://{s}@127.0.0.1:1/ST", "kafka://app:{s}@127.0.0.1:1/t?sasl=SCRAM-SHA-512",
    ],
)  # fmt: skip
def test_what_a_secured_url_builds_shows_no_secret(url: str) -> None:
    """The parts a URL builds (its source, sink and dead-letter sink, as ``aisp run`` and a
    pipeline file make them) and everything that describes them (``describe``, which the run
    summary, the dashboard and metrics labels show; ``repr``; the graph's rendering, which
    ``aisp topology`` prints) leave the secret out. Building connects to nothing."""
    import msgspec

    from aisp import Pipeline
    from aisp.connectors import connector_for, dead_letter_sink

    class Event(msgspec.Struct):
        id: int

    secret = "pw-9f1c2e"
    url = url.format(s=secret)
    connector = connector_for(url)
    parts: list[object] = [connector.source(url, Event), connector.sink(url, ["id"])]
    p = Pipeline("secured", output_columns=["id"])
    p.source("in", parts[0], schema=Event).sink("out", parts[1])
    if not url.startswith("kafka"):  # dead letters go to streams that store each record once
        parts.append(dead_letter_sink(url))
    shown = [p.build().render(), *(repr(x) for x in parts)]
    shown += [x.describe() for x in parts if hasattr(x, "describe")]
    assert all(secret not in text for text in shown), shown
