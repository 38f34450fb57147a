"""Kafka with a SASL login (PLAIN, SCRAM-SHA-256, SCRAM-SHA-512), with and without TLS: Tansu cannot
serve either, so a gateway in front of it does (``tests/support/kafka_gateway.py``: the SASL
exchange and TLS, then bytes relayed). The fraud example reads and writes through it, every
event once; a wrong password or an untrusted certificate ends the run at once and says so; no
byte AISP prints or writes holds the password."""

from __future__ import annotations

import ssl
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from aisp.connectors.access import Access
from aisp.connectors.base import free_port
from aisp.connectors.kafka.changelog import changelog_topic
from aisp.connectors.kafka.client import security_settings
from aisp.connectors.kafka.connector import fill_topic, read_topic, tansu_broker
from tests.integration.test_redis_security import SECRET, _run
from tests.integration.test_redis_security import reference as reference  # a fixture, shared
from tests.support.kafka_gateway import Gateway, kafka_gateway
from tests.support.tls import Pair, issue, make_ca


@dataclass(frozen=True)
class SecuredKafka:
    plain: Gateway  # SASL over plain TCP
    tls: Gateway  # SASL over TLS
    ca: Pair
    stranger: Pair


@pytest.fixture(scope="module")
def kafka(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SecuredKafka]:
    d = tmp_path_factory.mktemp("kafka-tls")
    ca = make_ca(d)
    server = issue(ca, d, "server", server=True)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(server.cert, server.key)
    users = {"app": SECRET}
    (p1, g1), (p2, g2) = (free_port(), free_port()), (free_port(), free_port())
    with (
        tansu_broker(p1, advertised_port=g1),
        tansu_broker(p2, advertised_port=g2),
        kafka_gateway(("127.0.0.1", p1), g1, users) as plain,
        kafka_gateway(("127.0.0.1", p2), g2, users, tls=context) as tls,
    ):
        yield SecuredKafka(plain, tls, ca, make_ca(d / "other", "stranger"))


def _case(kafka: SecuredKafka, mechanism: str, tls: bool) -> tuple[str, str, dict[str, object]]:
    """(address, query, librdkafka settings) of a login with ``mechanism``, over TLS or not."""
    gateway = kafka.tls if tls else kafka.plain
    query = f"sasl={mechanism}" + (f"&tls=1&ca={kafka.ca.cert}" if tls else "")
    access = Access("app", SECRET, tls=tls, ca=str(kafka.ca.cert) if tls else None)
    return f"127.0.0.1:{gateway.port}", query, security_settings(access, mechanism)


@pytest.mark.parametrize(
    ("mechanism", "tls"),
    [
        ("PLAIN", False),
        # SCRAM-SHA-256 over TLS: the changelog test below runs the example through it
        pytest.param("SCRAM-SHA-256", True, marks=pytest.mark.slow),
        pytest.param("SCRAM-SHA-512", False, marks=pytest.mark.slow),
        pytest.param("PLAIN", True, marks=pytest.mark.slow),
        pytest.param("SCRAM-SHA-256", False, marks=pytest.mark.slow),
        pytest.param("SCRAM-SHA-512", True, marks=pytest.mark.slow),
    ],
)
def test_the_fraud_example_runs_through_a_kafka_login_every_event_once_and_nothing_leaks(
    kafka: SecuredKafka,
    reference: tuple[list[bytes], list[str], int],
    tmp_path: Path,
    mechanism: str,
    tls: bool,
) -> None:
    events, expected, dead_letters = reference
    address, query, settings = _case(kafka, mechanism, tls)
    tag = uuid.uuid4().hex[:8]
    source, output = f"in-{tag}", f"out-{tag}"
    fill_topic(address, source, events, settings=settings)
    base = f"kafka://app:{SECRET}@{address}"
    summary, dead = tmp_path / "summary.json", tmp_path / "dl.jsonl"
    res = _run(
        "--input", f"{base}/{source}?{query}&idle_stop_s=2&group=g-{tag}",
        "--output", f"{base}/{output}?{query}", "--dead-letter", str(dead), "--summary-json", str(summary),
    )  # fmt: skip
    assert res.returncode == 0, res.stderr[-3000:]
    assert sorted(line.decode() for line in read_topic(address, output, settings=settings)) == expected
    assert len(dead.read_text().splitlines()) == dead_letters
    printed = res.stdout + res.stderr + summary.read_text() + dead.read_text()
    assert SECRET not in printed
    gateway = kafka.tls if tls else kafka.plain
    assert (mechanism, "app", True) in gateway.logins


@pytest.mark.parametrize(
    ("case", "says"),
    [("wrong password", "authentication failed"), ("untrusted certificate", "TLS handshake failed")],
)
def test_a_refused_login_or_an_untrusted_broker_ends_the_run_at_once_and_says_so(
    kafka: SecuredKafka, tmp_path: Path, case: str, says: str
) -> None:
    """Not retried as an outage: the run ends well before its retry_s (60 s here), with a line
    that names the broker and what failed, no traceback and no secret."""
    if case == "wrong password":
        address = f"127.0.0.1:{kafka.plain.port}"
        url = f"kafka://app:{SECRET}x@{address}/t?sasl=SCRAM-SHA-256&retry_s=60"
    else:
        address = f"127.0.0.1:{kafka.tls.port}"
        url = f"kafka://app:{SECRET}@{address}/t?sasl=PLAIN&tls=1&ca={kafka.stranger.cert}&retry_s=60"
    started = time.monotonic()
    res = _run("--input", url, "--output", str(tmp_path / "o.jsonl"))
    took = time.monotonic() - started
    assert res.returncode != 0
    assert took < 60, (took, res.stderr[-2000:])
    stderr = " ".join(res.stderr.split())
    assert says in stderr and address in stderr, res.stderr[-2000:]
    assert "Traceback" not in res.stderr and SECRET not in res.stdout + res.stderr


def test_state_in_changelog_topics_logs_in_as_the_input_does(
    kafka: SecuredKafka, reference: tuple[list[bytes], list[str], int], tmp_path: Path
) -> None:
    """``--partition-state changelog``: the changelogs' admin, producer and readers reach the
    input's broker with its login and TLS (every connection without it is closed by the broker),
    every event once, and no checkpoint file holds the password."""
    events, expected, _ = reference
    address, query, settings = _case(kafka, "SCRAM-SHA-256", True)
    tag = uuid.uuid4().hex[:8]
    source, output, group = f"in-{tag}", f"out-{tag}", f"g-{tag}"
    fill_topic(address, source, events, settings=settings)
    before = len(kafka.tls.logins)
    base = f"kafka://app:{SECRET}@{address}"
    chk = tmp_path / "chk"
    res = _run(
        "--input", f"{base}/{source}?{query}&idle_stop_s=2&group={group}",
        "--output", f"{base}/{output}?{query}",
        "--dead-letter", str(tmp_path / "dl.jsonl"), "--checkpoint-dir", str(chk),
        "--partition-state", "changelog", "--checkpoint-interval-s", "0.25",
    )  # fmt: skip
    assert res.returncode == 0, res.stderr[-3000:]
    assert sorted(line.decode() for line in read_topic(address, output, settings=settings)) == expected
    changelog = changelog_topic(group, source, "user_stats")
    assert read_topic(address, changelog, settings=settings), "the keyed state went to its changelog"
    logins = kafka.tls.logins[before:]
    assert len(logins) > 4 and all(ok for *_, ok in logins)  # the run's clients and the changelogs'
    files = b"".join(f.read_bytes() for f in chk.rglob("*") if f.is_file())
    assert SECRET.encode() not in files and SECRET not in res.stdout + res.stderr
