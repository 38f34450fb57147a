"""Redis as production runs it: an ACL user (the default user off) and TLS (a CA made here, mutual
TLS on request). The fraud example reads and writes through it, every event once, with the
password in the URL, in a variable or in a file; a refused password, an unknown user or an
untrusted certificate ends the run at once and says so; and no byte AISP prints or writes
holds the password."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from aisp.connectors.base import free_port, wait_for_port
from aisp.connectors.redis.connector import RedisConnector
from benchmarks.workload import write_events
from tests.integration.test_exactly_once import ENV, PIPELINE
from tests.support.tls import Pair, issue, make_ca

SECRET = f"pw-{uuid.uuid4().hex}"  # drawn: a scan for it finds only what leaked
EVENTS = 3_000


@dataclass(frozen=True)
class SecuredRedis:
    port: int
    tls_port: int
    ca: Pair
    client: Pair
    stranger: Pair  # a CA the server's certificate does not chain to


@pytest.fixture(scope="module")
def redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SecuredRedis]:
    d = tmp_path_factory.mktemp("redis-tls")
    ca = make_ca(d)
    server = issue(ca, d, "server", server=True)
    client = issue(ca, d, "client", server=False)
    stranger = make_ca(d / "other", "stranger")
    port, tls_port = free_port(), free_port()
    cmd = [
        "redis-server", "--bind", "127.0.0.1", "--port", str(port), "--tls-port", str(tls_port),
        "--tls-cert-file", str(server.cert), "--tls-key-file", str(server.key),
        "--tls-ca-cert-file", str(ca.cert), "--tls-auth-clients", "optional",
        "--user", "default", "off", "--user", "app", "on", f">{SECRET}", "~*", "&*", "+@all",
        "--save", "", "--appendonly", "no", "--dir", str(d),
    ]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_for_port(tls_port, lambda: proc.poll() is None, "redis-server")
        yield SecuredRedis(port, tls_port, ca, client, stranger)
    finally:
        proc.kill()
        proc.wait()


def _run(
    *args: str, env: dict[str, str] | None = None, timeout: float = 300
) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "aisp.cli", "run", str(PIPELINE), "--no-live", *args]
    return subprocess.run(cmd, env=env or ENV, capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[bytes], list[str], int]:
    """The events (a malformed line now and then), the outputs of a run over a file and the
    number of its dead letters."""
    d = tmp_path_factory.mktemp("redis-ref")
    data, out = d / "events.jsonl", d / "out.jsonl"
    write_events(data, EVENTS, seed=5, bad_every=97)
    res = _run("--input", str(data), "--output", str(out), "--dead-letter", str(d / "dl.jsonl"))
    assert res.returncode == 0, res.stderr
    dead = len((d / "dl.jsonl").read_text().splitlines())
    return data.read_bytes().splitlines(), sorted(out.read_text().splitlines()), dead


@pytest.mark.parametrize(
    # the password in the URL: the status-page test below runs the example through it
    "form",
    [pytest.param("url", marks=pytest.mark.slow), "env", "file+mtls"],
)
def test_the_fraud_example_runs_through_a_secured_redis_every_event_once_and_nothing_leaks(
    redis: SecuredRedis, reference: tuple[list[bytes], list[str], int], tmp_path: Path, form: str
) -> None:
    events, expected, dead_letters = reference
    env = dict(ENV)
    tls = f"ca={redis.ca.cert}"
    if form == "url":
        base, query = f"redis://app:{SECRET}@127.0.0.1:{redis.port}", ""
    elif form == "env":
        env["AISP_TEST_REDIS_PASSWORD"] = SECRET
        base, query = (
            f"rediss://app@127.0.0.1:{redis.tls_port}",
            f"password_env=AISP_TEST_REDIS_PASSWORD&{tls}",
        )
    else:
        secret_file = tmp_path / "password"
        secret_file.write_text(SECRET + "\n")
        client = f"cert={redis.client.cert}&key={redis.client.key}"
        base = f"redis://app@127.0.0.1:{redis.tls_port}"
        query = f"password_file={secret_file}&tls=1&{tls}&{client}"
    tag = uuid.uuid4().hex[:8]
    url = {s: f"{base}/{s}-{tag}?{query}" for s in ("in", "out", "dl")}
    connector = RedisConnector()
    if form == "env":  # the scenario tools (fill, read) resolve the variable too
        os.environ["AISP_TEST_REDIS_PASSWORD"] = SECRET
    connector.fill(url["in"], events)
    summary = tmp_path / "summary.json"
    res = _run(
        "--input", f"{url['in']}&idle_stop_s=2", "--output", url["out"], "--dead-letter", url["dl"],
        "--summary-json", str(summary), env=env,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr[-3000:]
    got = [line.decode() for line in connector.read(url["out"])]
    assert sorted(got) == expected  # every event once
    dead = connector.read(url["dl"])
    assert len(dead) == dead_letters > 0
    printed = res.stdout + res.stderr + summary.read_text() + b"".join(dead).decode()
    assert SECRET not in printed
    for u in url.values():
        connector.drop(u)


@pytest.mark.parametrize(
    ("case", "says"),
    [
        ("wrong password", "authentication failed"),
        ("unknown user", "authentication failed"),
        ("no password", "authentication failed"),
        ("untrusted certificate", "TLS verification failed"),
    ],
)
def test_a_refused_login_or_an_untrusted_server_ends_the_run_at_once_and_says_so(
    redis: SecuredRedis, tmp_path: Path, case: str, says: str
) -> None:
    """Not retried as an outage: the run ends well before its retry_s (60 s here), with one line
    that names the broker and what failed, no traceback and no secret."""
    port = redis.port
    creds = {"wrong password": f"app:{SECRET}x@", "unknown user": f"nobody:{SECRET}@", "no password": ""}
    if case == "untrusted certificate":
        url = f"rediss://app:{SECRET}@127.0.0.1:{redis.tls_port}/in?ca={redis.stranger.cert}"
        port = redis.tls_port
    else:
        url = f"redis://{creds[case]}127.0.0.1:{port}/in"
    started = time.monotonic()
    res = _run(
        "--input", f"{url}{'&' if '?' in url else '?'}retry_s=60", "--output", str(tmp_path / "o.jsonl")
    )
    took = time.monotonic() - started
    assert res.returncode != 0
    assert took < 60, (took, res.stderr[-2000:])
    assert says in res.stderr and f"127.0.0.1:{port}" in res.stderr, res.stderr[-2000:]
    assert "Traceback" not in res.stderr and SECRET not in res.stdout + res.stderr


def test_a_bad_url_is_refused_with_its_secret_masked(redis: SecuredRedis, tmp_path: Path) -> None:
    url = f"redis://app:{SECRET}@127.0.0.1:{redis.port}/in?grop=1"
    res = _run("--input", url, "--output", str(tmp_path / "o.jsonl"))
    assert res.returncode != 0 and "unknown option 'grop'" in res.stderr
    assert f"redis://app:***@127.0.0.1:{redis.port}/in" in res.stderr and SECRET not in res.stderr
    again = _run("--input", f"redis://app@127.0.0.1:{redis.port}/in?password_env=AISP_NOT_SET_ANYWHERE",
                 "--output", str(tmp_path / "o.jsonl"))  # fmt: skip
    assert again.returncode != 0 and "AISP_NOT_SET_ANYWHERE: the variable is not set" in again.stderr
    assert json.dumps(SECRET) not in again.stderr


def test_aisp_serve_with_dead_letters_behind_a_refused_login_fails_at_start(
    redis: SecuredRedis, tmp_path: Path
) -> None:
    """A served pipeline whose dead letters go to a broker that refuses the login does not start:
    one line names the broker and the refusal, at once, no traceback, no secret."""
    url = f"redis://app:{SECRET}x@127.0.0.1:{redis.port}/dl"
    cmd = [sys.executable, "-m", "aisp.cli", "serve", str(PIPELINE), "--http-port", "0", "--grpc-port", "-1",
           "--no-decode-process", "--dead-letter", url]  # fmt: skip
    started = time.monotonic()
    res = subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=120)
    assert res.returncode != 0 and time.monotonic() - started < 60, res.stderr[-2000:]
    stderr = " ".join(res.stderr.split())
    assert "authentication failed" in stderr and f"127.0.0.1:{redis.port}" in stderr, res.stderr[-2000:]
    assert "Traceback" not in res.stderr and SECRET not in res.stdout + res.stderr


def test_no_status_page_or_checkpoint_holds_the_password(
    redis: SecuredRedis, reference: tuple[list[bytes], list[str], int], tmp_path: Path
) -> None:
    """While a run reads and writes through a login: /metrics, the dashboard's page and its state,
    and afterwards the checkpoints (manifests and state files) and the summary, never hold the
    password; the run still gives every event once."""
    import urllib.request

    events, expected, _ = reference
    tag = uuid.uuid4().hex[:8]
    base = f"redis://app:{SECRET}@127.0.0.1:{redis.port}"
    connector = RedisConnector()
    connector.fill(f"{base}/in-{tag}", events)
    chk, summary = tmp_path / "chk", tmp_path / "summary.json"
    cmd = [
        sys.executable, "-m", "aisp.cli", "run", str(PIPELINE), "--no-live",
        "--input", f"{base}/in-{tag}?idle_stop_s=2", "--output", f"{base}/out-{tag}",
        "--dead-letter", f"{base}/dl-{tag}", "--rate", str(len(events) // 6),  # ~6 s: pages read meanwhile
        "--metrics-port", "0", "--dashboard", "--checkpoint-dir", str(chk), "--summary-json", str(summary),
    ]  # fmt: skip
    proc = subprocess.Popen(cmd, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    pages: list[str] = []
    lines: list[str] = []
    try:
        assert proc.stderr is not None
        url = ""
        for line in proc.stderr:
            lines.append(line)
            if line.startswith("metrics http://"):
                url = line.split()[1].removesuffix("/metrics")
                break
        assert url, "no metrics address announced: " + "".join(lines)[-2000:]
        state: dict[str, object] = {}
        checkpoint_s = 0.0
        while not state.get("events_out") or checkpoint_s <= 0:  # scoring, and checkpointed once
            assert proc.poll() is None, "the run ended before its pages were read"
            time.sleep(0.3)
            for path in ("/metrics", "/dashboard", "/dashboard/state?history=1"):
                pages.append(urllib.request.urlopen(url + path, timeout=30).read().decode())
            state = json.loads(pages[-1])
            found = re.search(r"^aisp_checkpoint_last_seconds (\S+)$", pages[-3], re.MULTILINE)
            checkpoint_s = float(found.group(1)) if found else 0.0
        out, err = proc.communicate(timeout=240)
    finally:  # a failed assertion must not leave the run behind
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, err[-3000:]
    assert sorted(x.decode() for x in connector.read(f"{base}/out-{tag}")) == expected
    assert any("aisp_events_total" in page for page in pages)
    printed = "".join(pages) + out + "".join(lines) + err + summary.read_text()
    assert SECRET not in printed
    files = [f for f in chk.rglob("*") if f.is_file()]
    assert any(f.name == "manifest.json" for f in files)
    assert not [f for f in files if SECRET.encode() in f.read_bytes()]
    for stream in ("in", "out", "dl"):
        connector.drop(f"{base}/{stream}-{tag}")
