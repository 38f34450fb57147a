"""What AISP's Kafka clients (librdkafka, through ``confluent-kafka``) share: settings that keep
a client out of known librdkafka hangs, and a bound on calls that may block past their timeout.

``metadata.recovery.strategy=none``. librdkafka (2.10 and later) re-bootstraps a client whose
known brokers all stayed unreachable, decommissioning their handles; a handle so decommissioned
can stay cached as the group coordinator, and a transactional ``send_offsets_to_transaction``
that waits for it never returns, its own timeout unchecked (librdkafka#5511 and #5456, open in
2.16). Seen here: the only broker blackholed for 10 s once the input was read hung the run for
good, after the broker was back. The brokers a pipeline names are its bootstrap addresses, so
re-bootstrapping finds nothing new; a client whose brokers move can set it back in ``options``.

``logger``: librdkafka's own log lines (a refused connection is logged by every client at every
reconnect, hundreds of lines a minute) go to the ``aisp.kafka.librdkafka`` logger at DEBUG: AISP
reports broker trouble itself, once, with the broker's address (retries counted in
``aisp_retries_total``, then a clear error); ``AISP_LOG_LEVEL=DEBUG`` shows them.

``error_code``: what a confluent-kafka exception says, as librdkafka's error code
(``KafkaError.code()``), so that callers decide by the code, never by the message's text.

``bounded``: a call that may still hang (another librdkafka path, a broker that half answers)
runs on a helper thread and is given up after its own timeout and a grace period: the caller
gets a clear error, not a process that hangs for good.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any, TypeVar

from aisp.connectors.access import Access

__all__ = [
    "CLIENT_SETTINGS",
    "SASL_MECHANISMS",
    "security_settings",
    "GRACE_S",
    "CallStuck",
    "bounded",
    "error_code",
    "final_reason",
    "is_unknown_topic",
]


class _AtDebug(logging.Filter):
    """Every record at DEBUG, whatever level librdkafka gave it."""

    def filter(self, record: logging.LogRecord) -> bool:
        record.levelno, record.levelname = logging.DEBUG, "DEBUG"
        return True


LIBRDKAFKA_LOG = logging.getLogger("aisp.kafka.librdkafka")
LIBRDKAFKA_LOG.addFilter(_AtDebug())

CLIENT_SETTINGS: dict[str, Any] = {
    "metadata.recovery.strategy": "none",
    "logger": LIBRDKAFKA_LOG,
    # a broker back after an outage is reached within 2 s (librdkafka's default backs off up to
    # 10 s: a 15 s cut of the broker's host cost 8-15 s more before the group was whole again)
    "reconnect.backoff.max.ms": 2000,
}
GRACE_S = 15.0
"""How long past its own timeout a call may take before it counts as stuck."""

T = TypeVar("T")


def error_code(exc: BaseException) -> int | None:
    """The librdkafka error code ``exc`` carries (a ``KafkaException`` holding a ``KafkaError``,
    as an admin future raises), or None for any other exception."""
    from confluent_kafka import KafkaError, KafkaException

    if isinstance(exc, KafkaException) and exc.args and isinstance(exc.args[0], KafkaError):
        return int(exc.args[0].code())
    return None


def is_unknown_topic(exc: BaseException) -> bool:
    """Whether ``exc`` says a topic does not exist (by name or by id; the broker's or the
    client's own code)."""
    from confluent_kafka import KafkaError

    unknown = (KafkaError.UNKNOWN_TOPIC_OR_PART, KafkaError._UNKNOWN_TOPIC, KafkaError.UNKNOWN_TOPIC_ID)
    return error_code(exc) in unknown


SASL_MECHANISMS = ("PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512")


def security_settings(access: Access, sasl: str | None) -> dict[str, Any]:
    """librdkafka's settings for ``access`` and the SASL mechanism ``sasl``: ``security.protocol``
    SASL_SSL, SASL_PLAINTEXT, SSL or PLAINTEXT, the login and the TLS files.

    >>> sorted(security_settings(Access("u", "p", tls=True, ca="ca.pem"), "SCRAM-SHA-256").items())
    ... # doctest: +NORMALIZE_WHITESPACE
    [('sasl.mechanism', 'SCRAM-SHA-256'), ('sasl.password', 'p'), ('sasl.username', 'u'),
     ('security.protocol', 'SASL_SSL'), ('ssl.ca.location', 'ca.pem')]
    """
    out: dict[str, Any] = {}
    if sasl is not None:
        out.update(
            {
                "sasl.mechanism": sasl,
                "sasl.username": access.user or "",
                "sasl.password": access.password or "",
            }
        )
    out["security.protocol"] = ("SASL_" if sasl else "") + ("SSL" if access.tls else "PLAINTEXT")
    if out["security.protocol"] == "PLAINTEXT":
        return {}
    files = {
        "ssl.ca.location": access.ca,
        "ssl.certificate.location": access.cert,
        "ssl.key.location": access.key,
    }
    return {**out, **{k: v for k, v in files.items() if access.tls and v is not None}}


def final_reason(exc: BaseException) -> str | None:
    """Why ``exc`` will not pass by waiting: the broker refused the login, its certificate, or
    the operation (an ACL); None for an outage (retry it)."""
    from confluent_kafka import KafkaError

    code = error_code(exc)
    if code in (KafkaError.SASL_AUTHENTICATION_FAILED, KafkaError._AUTHENTICATION):
        return "authentication failed"
    if code == KafkaError._SSL:
        return "TLS handshake failed (or the broker's certificate is not trusted)"
    denied = (
        KafkaError.TOPIC_AUTHORIZATION_FAILED, KafkaError.GROUP_AUTHORIZATION_FAILED,
        KafkaError.CLUSTER_AUTHORIZATION_FAILED, KafkaError.TRANSACTIONAL_ID_AUTHORIZATION_FAILED,
    )  # fmt: skip
    if code in denied:
        return "not permitted (the broker's ACLs refuse it)"
    return None


class CallStuck(Exception):
    """A client call did not return within its bound (the client cannot be used again)."""


def bounded(what: str, call: Callable[[], T], timeout_s: float) -> T:
    """``call()``'s result or exception, or ``CallStuck`` if it has not returned after
    ``timeout_s`` (the helper thread is left to it: a daemon, it does not keep the process up)."""
    done = threading.Event()
    result: list[Any] = []

    def run() -> None:
        try:
            result.append((True, call()))
        except BaseException as exc:  # noqa: BLE001 - handed to the caller as it is
            result.append((False, exc))
        finally:
            done.set()

    threading.Thread(target=run, name=f"aisp-kafka-{what}", daemon=True).start()
    if not done.wait(timeout_s):
        raise CallStuck(f"{what} did not return within {timeout_s:g} s")
    ok, value = result[0]
    if ok:
        return value  # type: ignore[no-any-return]
    raise value
