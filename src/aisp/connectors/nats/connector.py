"""``nats://HOST:PORT/STREAM``: a NATS JetStream stream of JSON events.

Input options: ``durable`` (the pull consumer, default ``aisp``), ``subject`` (a filter),
``idle_stop_s``, ``retry_s``. Output options: ``subject`` (default ``STREAM.out``; the stream is
created if missing), ``duplicate_window_s`` (3600, for a stream it creates), ``retry_s``. Dead
letters and alerts: ``subject``. Load target (``aisp bench``):
``nats://HOST:PORT/IN?output=OUT[&subject=IN.bench][&output_subject=OUT.out]`` (the streams are
created when they do not exist).
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any, ClassVar, TypeVar

import msgspec
from msgspec import UNSET, UnsetType

from aisp.connectors.access import Access, SecuredOptions, access_of, access_options
from aisp.connectors.base import (
    DEFAULT_SHAPE,
    Connector,
    LoadClient,
    PrivateBroker,
    ScenarioShape,
    binary,
    broker_process,
    free_port,
)
from aisp.connectors.nats.client import connect_nats
from aisp.connectors.nats.sink import JetStreamSink, ensure_stream
from aisp.connectors.nats.source import JetStreamSource
from aisp.connectors.url import Address, mask, options
from aisp.errors import ConfigError
from aisp.ingest.base import Source
from aisp.sinks.base import Sink

__all__ = ["NatsConnector"]

T = TypeVar("T")
_PORT = 4222


class NatsOptions(SecuredOptions):
    """What every NATS URL may add to the secured options: a credentials file."""

    creds: str | UnsetType = UNSET
    """An NKey/JWT credentials file (``nsc`` makes them)."""

    ACCESS: ClassVar[tuple[str, ...]] = ("creds",)


def _access(url: str, opts: NatsOptions) -> Access:
    """``url``'s access; a user without a password (``nats://TOKEN@HOST``) is a token, kept as
    the password (so that no repr shows it)."""
    access = access_of(url, _address(url), opts)
    if access.user is not None and access.password is None:
        access = replace(access, user=None, password=access.user)
    return replace(access, creds=opts.creds) if isinstance(opts.creds, str) else access


class NatsInput(NatsOptions):
    """``nats://HOST:PORT/STREAM?...`` as an input (defaults: ``JetStreamSource``'s)."""

    durable: str | UnsetType = UNSET
    subject: str | UnsetType = UNSET
    idle_stop_s: float | UnsetType = UNSET
    """End the input after that long without a message (default: never)."""
    retry_s: float | UnsetType = UNSET


class NatsOutput(NatsOptions):
    """``nats://HOST:PORT/STREAM?...`` as an output (defaults: ``JetStreamSink``'s)."""

    subject: str | UnsetType = UNSET
    duplicate_window_s: float | UnsetType = UNSET
    retry_s: float | UnsetType = UNSET


class NatsRecords(NatsOptions):
    """``nats://HOST:PORT/STREAM?subject=S`` for dead letters and alerts."""

    subject: str | None = None


class NatsLoad(NatsOptions):
    """``nats://HOST:PORT/IN?output=OUT[&subject=S&output_subject=S]`` as an ``aisp bench`` target."""

    output: str = ""
    subject: str = ""
    output_subject: str = ""


def _address(url: str) -> Address:
    return Address.parse(url, _PORT, "stream")


def _servers(a: Address) -> str:
    return f"nats://{a.hostport}"


def _run(coro: Coroutine[Any, Any, T]) -> T:
    try:
        return asyncio.run(coro)
    except OSError as exc:
        raise ConfigError(f"NATS is not reachable: {exc}") from exc


async def _connect(url: str) -> Any:
    """A connection for the scenario tools: one try, credentials and TLS as ``url`` says."""
    return await connect_nats(
        _servers(_address(url)), _access(url, access_options(url, NatsOptions)), reconnect=False
    )


class NatsConnector(Connector):
    scheme = "nats"
    shared_address = f"127.0.0.1:{_PORT}"

    def source(self, url: str, schema: type[msgspec.Struct]) -> Source:
        a = _address(url)
        given = options(url, NatsInput)
        opts = given.plain()
        idle = opts.pop("idle_stop_s", None)
        return JetStreamSource(
            stream=a.name, schema=schema, servers=_servers(a), stop_when_idle_s=idle,
            access=_access(url, given), **opts,
        )  # fmt: skip

    def sink(self, url: str, columns: Sequence[str] | None) -> Sink:
        a = _address(url)
        given = options(url, NatsOutput)
        return JetStreamSink(
            stream=a.name, servers=_servers(a), columns=columns, access=_access(url, given), **given.plain()
        )

    def record_sink(self, url: str) -> Sink:
        a = _address(url)
        given = options(url, NatsRecords)
        return JetStreamSink(
            stream=a.name, servers=_servers(a), subject=given.subject, access=_access(url, given)
        )

    def scenario_urls(self, address: str, tag: str, shape: ScenarioShape = DEFAULT_SHAPE) -> tuple[str, str]:
        self._one_partition(shape)
        base = f"nats://{address}"
        durable = "durable=chaos&" if shape.group else ""
        return f"{base}/CHAOSIN{tag}?{durable}idle_stop_s=2", f"{base}/CHAOSOUT{tag}"

    def fill(self, url: str, lines: Sequence[bytes], shape: ScenarioShape = DEFAULT_SHAPE) -> None:
        self._one_partition(shape)
        _run(self._fill(url, lines))

    async def _fill(self, url: str, lines: Sequence[bytes]) -> None:
        from nats.js.api import StreamConfig

        a = _address(url)
        nc = await _connect(url)
        js = nc.jetstream()
        await js.add_stream(StreamConfig(name=a.name, subjects=[f"{a.name}.>"]))
        for i in range(0, len(lines), 1000):
            await asyncio.gather(*(js.publish(f"{a.name}.ev", x) for x in lines[i : i + 1000]))
        await nc.close()

    def read(self, url: str) -> list[bytes]:
        return _run(self._read(url))

    async def _read(self, url: str) -> list[bytes]:
        import nats
        from nats.js.api import AckPolicy, ConsumerConfig

        a = _address(url)
        nc = await _connect(url)
        js = nc.jetstream()
        sub = await js.pull_subscribe("", stream=a.name, config=ConsumerConfig(ack_policy=AckPolicy.NONE))
        out: list[bytes] = []
        while True:
            try:
                out += [m.data for m in await sub.fetch(1000, timeout=1)]
            except (nats.errors.TimeoutError, TimeoutError):  # nothing more (either class, by version)
                break
        await nc.close()
        return out

    def drop(self, url: str) -> None:
        _run(self._drop(url))

    async def _drop(self, url: str) -> None:
        import nats

        a = _address(url)
        nc = await _connect(url)
        try:
            await nc.jetstream().delete_stream(a.name)
        except nats.js.errors.NotFoundError:
            pass
        await nc.close()

    @contextmanager
    def private_broker(
        self, store: Path, *, port: int | None = None, advertised_port: int | None = None
    ) -> Iterator[PrivateBroker]:
        """``nats-server -js`` keeping its streams in ``store``."""
        port = port or free_port()
        store.mkdir(parents=True, exist_ok=True)
        server = binary("nats-server", "/usr/sbin/nats-server")
        cmd = [server, "-a", "127.0.0.1", "-p", str(port), "-js", "-sd", str(store)]
        with broker_process(cmd, port, "nats-server") as broker:
            yield broker

    def load_client(self, url: str) -> LoadClient:
        return _JetStreamLoad(url)


class _JetStreamLoad(LoadClient):
    """Events published to ``subject`` of stream ``IN``, results read from stream ``OUT``
    (new messages only, an ephemeral consumer)."""

    def __init__(self, url: str) -> None:
        self.address = _address(url)
        opts = options(url, NatsLoad)
        if not opts.output:
            raise ConfigError(f"{mask(url)!r}: give the output stream, as nats://HOST:PORT/IN?output=OUT")
        self.stream, self.output = self.address.name, opts.output
        self.subject = opts.subject or f"{self.stream}.bench"
        self.output_subject = opts.output_subject or f"{self.output}.out"
        self._access = _access(url, opts)
        self._nc: Any = None
        self._sub: Any = None

    async def connect(self) -> None:
        from nats.js.api import DeliverPolicy, StreamConfig

        self._nc = await connect_nats(_servers(self.address), self._access, reconnect=False)
        js = self._nc.jetstream()
        for name, subjects in ((self.stream, [f"{self.stream}.>"]), (self.output, [self.output_subject])):
            await ensure_stream(js, StreamConfig(name=name, subjects=subjects))
        self._js = js
        self._sub = await js.subscribe(
            self.output_subject, stream=self.output, ordered_consumer=True, deliver_policy=DeliverPolicy.NEW
        )

    async def publish(self, events: list[bytes]) -> None:
        await asyncio.gather(*(self._js.publish(self.subject, event) for event in events))

    async def results(self) -> list[bytes]:
        import nats

        out = []
        try:
            out.append((await self._sub.next_msg(timeout=0.05)).data)
            while True:
                out.append((await self._sub.next_msg(timeout=0.0001)).data)
        except nats.errors.TimeoutError:  # nothing more now
            return out

    async def close(self) -> None:
        if self._nc is not None:
            await self._nc.close()
