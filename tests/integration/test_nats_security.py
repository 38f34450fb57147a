"""NATS JetStream as production runs it: one server with users and passwords, one with a token and
TLS (a CA made here), one that trusts an operator's JWTs and asks for a client certificate (a
credentials file and mutual TLS). The fraud example reads and writes through each, every event
once, the secret in the URL, in a variable or in a credentials file; a refused login, an untrusted
server or a missing client certificate ends the run at once and says so; and no byte AISP prints
or writes holds the secret."""

from __future__ import annotations

import json
import os
import subprocess
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from aisp.connectors.base import free_port, wait_for_port
from aisp.connectors.nats.connector import NatsConnector
from tests.integration.test_exactly_once import ENV
from tests.integration.test_redis_security import SECRET, _run
from tests.integration.test_redis_security import reference as reference  # a fixture, shared
from tests.support.nats_jwt import Operator
from tests.support.tls import Pair, issue, make_ca

TOKEN = f"tok-{uuid.uuid4().hex}"


@dataclass(frozen=True)
class SecuredNats:
    users_port: int  # users and passwords, no TLS
    tls_port: int  # a token, TLS
    creds_port: int  # an operator's JWTs, mutual TLS
    ca: Pair
    stranger: Pair
    client: Pair  # a client certificate of ``ca``
    creds: Path  # a user of the operator's account
    seed: str  # the user's NKey seed: the secret of ``creds``
    operator: Operator


def _server(conf: Path, port: int) -> subprocess.Popen[bytes]:
    cmd = ["nats-server", "-c", str(conf)]
    log = conf.with_suffix(".log")
    with log.open("wb") as out:
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=out)
    try:
        wait_for_port(port, lambda: proc.poll() is None, "nats-server")
    except Exception:
        proc.kill()
        proc.wait()
        raise RuntimeError(f"nats-server -c {conf} did not start: {log.read_text()[-2000:]}") from None
    return proc


@pytest.fixture(scope="module")
def nats(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SecuredNats]:
    d = tmp_path_factory.mktemp("nats-tls")
    ca = make_ca(d)
    server = issue(ca, d, "server", server=True)
    stranger = make_ca(d / "other", "stranger")
    users_port, tls_port = free_port(), free_port()
    users = d / "users.conf"
    users.write_text(
        f'listen: "127.0.0.1:{users_port}"\njetstream {{ store_dir: "{d / "js1"}" }}\n'
        f'authorization {{ users = [ {{ user: app, password: "{SECRET}" }} ] }}\n'
    )
    tls = d / "tls.conf"
    tls.write_text(
        f'listen: "127.0.0.1:{tls_port}"\njetstream {{ store_dir: "{d / "js2"}" }}\n'
        f'authorization {{ token: "{TOKEN}" }}\n'
        f'tls {{ cert_file: "{server.cert}", key_file: "{server.key}" }}\n'
    )
    creds_port, operator = free_port(), Operator.new()
    mtls = d / "mtls.conf"
    mtls.write_text(
        f'listen: "127.0.0.1:{creds_port}"\njetstream {{ store_dir: "{d / "js3"}" }}\n'
        f"{operator.server_config()}tls {{ cert_file: {json.dumps(str(server.cert))},"
        f' key_file: "{server.key}", ca_file: "{ca.cert}", verify: true }}\n'
    )
    creds = operator.creds(d / "app.creds")
    seed = creds.read_text().split("-----BEGIN USER NKEY SEED-----\n")[1].split("\n")[0]
    client = issue(ca, d, "client", server=False)
    procs: list[subprocess.Popen[bytes]] = []
    try:  # each started inside: one that does not start must not leave the others running
        for conf, port in ((users, users_port), (tls, tls_port), (mtls, creds_port)):
            procs.append(_server(conf, port))
        yield SecuredNats(users_port, tls_port, creds_port, ca, stranger, client, creds, seed, operator)
    finally:
        for p in procs:
            p.kill()
            p.wait()


@pytest.mark.parametrize(
    "form", ["user+password in the url", "token from a variable, tls", "creds file, mutual tls"]
)
def test_the_fraud_example_runs_through_a_secured_nats_every_event_once_and_nothing_leaks(
    nats: SecuredNats, reference: tuple[list[bytes], list[str], int], tmp_path: Path, form: str
) -> None:
    events, expected, dead_letters = reference
    env = dict(ENV)
    if form.startswith("user"):
        secret, base, query = SECRET, f"nats://app:{SECRET}@127.0.0.1:{nats.users_port}", ""
    elif form.startswith("token"):
        os.environ["AISP_TEST_NATS_TOKEN"] = env["AISP_TEST_NATS_TOKEN"] = TOKEN  # the tools read it too
        secret, base = TOKEN, f"nats://127.0.0.1:{nats.tls_port}"
        query = f"password_env=AISP_TEST_NATS_TOKEN&tls=1&ca={nats.ca.cert}"
    else:
        secret, base = nats.seed, f"nats://127.0.0.1:{nats.creds_port}"
        query = f"creds={nats.creds}&ca={nats.ca.cert}&cert={nats.client.cert}&key={nats.client.key}"
    tag = uuid.uuid4().hex[:8].upper()
    url = {s: f"{base}/{s}{tag}?{query}" for s in ("IN", "OUT", "DL")}
    connector = NatsConnector()
    connector.fill(url["IN"], events)
    summary = tmp_path / "summary.json"
    res = _run(
        "--input", f"{url['IN']}&idle_stop_s=2", "--output", url["OUT"], "--dead-letter", url["DL"],
        "--summary-json", str(summary), env=env,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr[-3000:]
    assert sorted(line.decode() for line in connector.read(url["OUT"])) == expected  # every event once
    dead = connector.read(url["DL"])
    assert len(dead) == dead_letters > 0
    printed = res.stdout + res.stderr + summary.read_text() + b"".join(dead).decode()
    assert secret not in printed
    for u in url.values():
        connector.drop(u)


@pytest.mark.parametrize(
    ("case", "says"),
    [
        ("wrong password", "authentication failed"),
        ("wrong token", "authentication failed"),
        ("untrusted certificate", "TLS verification failed"),
        ("creds of an unknown signer", "authentication failed"),
        ("no client certificate", "TLS handshake failed"),
    ],
)
def test_a_refused_login_or_an_untrusted_server_ends_the_run_at_once_and_says_so(
    nats: SecuredNats, tmp_path: Path, case: str, says: str
) -> None:
    """Not retried as an outage: the run ends well before its retry_s (60 s here), with one line
    that names the broker and what failed, no traceback and no secret."""
    port = {"wrong password": nats.users_port, "wrong token": nats.tls_port,
            "untrusted certificate": nats.tls_port}.get(case, nats.creds_port)  # fmt: skip
    at = f"127.0.0.1:{port}/S?retry_s=60"
    client = f"cert={nats.client.cert}&key={nats.client.key}"
    if case == "creds of an unknown signer":
        stranger = nats.operator.creds(tmp_path / "stranger.creds", signer=nats.operator.operator)
        url = f"nats://{at}&creds={stranger}&ca={nats.ca.cert}&{client}"
    elif case == "no client certificate":
        url = f"nats://{at}&creds={nats.creds}&ca={nats.ca.cert}"
    elif case == "wrong password":
        url = f"nats://app:{SECRET}x@{at}"
    elif case == "wrong token":
        url = f"nats://{TOKEN}x@{at}&tls=1&ca={nats.ca.cert}"
    else:
        url = f"nats://{TOKEN}@{at}&ca={nats.stranger.cert}"
    started = time.monotonic()
    res = _run("--input", url, "--output", str(tmp_path / "o.jsonl"))
    took = time.monotonic() - started
    assert res.returncode != 0
    assert took < 60, (took, res.stderr[-2000:])
    assert says in res.stderr and f"127.0.0.1:{port}" in res.stderr, res.stderr[-2000:]
    assert "Traceback" not in res.stderr
    assert SECRET not in res.stdout + res.stderr and TOKEN not in res.stdout + res.stderr
    assert nats.seed not in res.stdout + res.stderr
