"""``redis://HOST:PORT/STREAM``: a Redis stream of JSON events in a field.

Input options: ``group`` (default ``aisp``), ``consumer`` (``aisp-1``), ``field`` (``data``),
``claim_idle_ms`` (30000), ``idle_stop_s`` (end the input after that long without an entry;
default: never), ``retry_s`` (how long a lost connection is retried before the run fails; 30).
Output options: ``field`` (``data``), ``dedupe_ttl_s`` (604800), ``retry_s`` (30). Dead letters
and alerts: ``field``. Load target (``aisp bench``): ``redis://HOST:PORT/IN?output=OUT[&field=data]``.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

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
from aisp.connectors.redis.client import redis_client, redis_kwargs
from aisp.connectors.redis.sink import RedisStreamSink
from aisp.connectors.redis.source import RedisStreamSource
from aisp.connectors.url import Address, mask, options
from aisp.errors import ConfigError
from aisp.ingest.base import Source
from aisp.sinks.base import Sink

__all__ = ["RedisConnector"]

_PORT = 6379


class RedisInput(SecuredOptions):
    """``redis://HOST:PORT/STREAM?...`` as an input (defaults: ``RedisStreamSource``'s)."""

    group: str | UnsetType = UNSET
    consumer: str | UnsetType = UNSET
    field: str | UnsetType = UNSET
    claim_idle_ms: int | UnsetType = UNSET
    idle_stop_s: float | UnsetType = UNSET
    """End the input after that long without an entry (default: never)."""
    retry_s: float | UnsetType = UNSET


class RedisOutput(SecuredOptions):
    """``redis://HOST:PORT/STREAM?...`` as an output (defaults: ``RedisStreamSink``'s)."""

    field: str | UnsetType = UNSET
    dedupe_ttl_s: int | UnsetType = UNSET
    retry_s: float | UnsetType = UNSET


class RedisRecords(SecuredOptions):
    """``redis://HOST:PORT/STREAM?field=F`` for dead letters and alerts."""

    field: str = "data"


class RedisLoad(SecuredOptions):
    """``redis://HOST:PORT/IN?output=OUT[&field=F]`` as an ``aisp bench`` target."""

    output: str = ""
    field: str = "data"


def _address(url: str) -> Address:
    return Address.parse(url, _PORT, "stream")


def _access(url: str, opts: SecuredOptions) -> Access:
    """Credentials and TLS of ``url`` (``rediss://``: TLS)."""
    return access_of(url, _address(url), opts, tls=url.startswith("rediss:"))


def _client(url: str) -> Any:
    """A synchronous client of ``url``'s server, checked to answer."""
    import redis

    a = _address(url)
    r = redis_client(a.host, a.port, _access(url, access_options(url, SecuredOptions)))
    try:
        r.ping()
    except redis.ConnectionError as exc:
        raise ConfigError(f"Redis is not reachable at {a.hostport}: {exc}") from exc
    return r


class RedisConnector(Connector):
    scheme = "redis"
    shared_address = f"127.0.0.1:{_PORT}"

    def source(self, url: str, schema: type[msgspec.Struct]) -> Source:
        a = _address(url)
        given = options(url, RedisInput)
        opts = given.plain()
        idle = opts.pop("idle_stop_s", None)
        return RedisStreamSource(
            stream=a.name, schema=schema, host=a.host, port=a.port, stop_when_idle_s=idle,
            access=_access(url, given), **opts,
        )  # fmt: skip

    def sink(self, url: str, columns: Sequence[str] | None) -> Sink:
        a = _address(url)
        given = options(url, RedisOutput)
        return RedisStreamSink(
            stream=a.name,
            host=a.host,
            port=a.port,
            columns=columns,
            access=_access(url, given),
            **given.plain(),
        )

    def record_sink(self, url: str) -> Sink:
        a = _address(url)
        given = options(url, RedisRecords)
        return RedisStreamSink(
            stream=a.name, host=a.host, port=a.port, field=given.field, access=_access(url, given)
        )

    def scenario_urls(self, address: str, tag: str, shape: ScenarioShape = DEFAULT_SHAPE) -> tuple[str, str]:
        self._one_partition(shape)
        base = f"redis://{address}"
        group = "group=chaos&" if shape.group else ""
        return f"{base}/aisp-chaos-in-{tag}?{group}idle_stop_s=2", f"{base}/aisp-chaos-out-{tag}"

    def fill(self, url: str, lines: Sequence[bytes], shape: ScenarioShape = DEFAULT_SHAPE) -> None:
        self._one_partition(shape)
        with _client(url) as r:  # closed: no socket left for the garbage collector
            pipe = r.pipeline(transaction=False)
            stream = _address(url).name
            for line in lines:
                pipe.xadd(stream, {"data": line})
            pipe.execute()

    def read(self, url: str) -> list[bytes]:
        with _client(url) as r:  # closed: no socket left for the garbage collector
            return [f[b"data"] for _, f in r.xrange(_address(url).name)]

    def drop(self, url: str) -> None:
        stream = _address(url).name
        with _client(url) as r:
            r.delete(stream)
            keys = list(r.scan_iter(f"aisp:dedupe:{stream}:*", count=10_000))
            for i in range(0, len(keys), 1000):
                r.delete(*keys[i : i + 1000])

    @contextmanager
    def private_broker(
        self, store: Path, *, port: int | None = None, advertised_port: int | None = None
    ) -> Iterator[PrivateBroker]:
        """``redis-server`` with an append-only file fsynced on every write in ``store``."""
        port = port or free_port()
        store.mkdir(parents=True, exist_ok=True)
        server = binary("redis-server", "/usr/bin/redis-server")
        cmd = [server, "--bind", "127.0.0.1", "--port", str(port), "--dir", str(store),
               "--save", "", "--appendonly", "yes", "--appendfsync", "always"]  # fmt: skip
        with broker_process(cmd, port, "redis-server") as broker:
            yield broker

    def load_client(self, url: str) -> LoadClient:
        return _RedisLoad(url)


class _RedisLoad(LoadClient):
    """Events XADDed to stream ``IN``, results read from stream ``OUT`` (field ``field``)."""

    def __init__(self, url: str) -> None:
        a = _address(url)
        opts = options(url, RedisLoad)
        if not opts.output:
            raise ConfigError(f"{mask(url)!r}: give the output stream, as redis://HOST:PORT/IN?output=OUT")
        self.host, self.port, self.stream, self.output = a.host, a.port, a.name, opts.output
        self.field = opts.field
        self._access = _access(url, opts)
        self._r: Any = None
        self._last: Any = b"0-0"

    async def connect(self) -> None:
        import redis.asyncio as redis

        self._r = redis.Redis(host=self.host, port=self.port, **redis_kwargs(self._access))
        last = await self._r.xrevrange(self.output, count=1)
        self._last = last[0][0] if last else b"0-0"

    async def publish(self, events: list[bytes]) -> None:
        pipe = self._r.pipeline(transaction=False)
        for event in events:
            pipe.xadd(self.stream, {self.field: event})
        await pipe.execute()

    async def results(self) -> list[bytes]:
        reply = await self._r.xread({self.output: self._last}, count=1000, block=50)
        out = []
        for _, entries in reply or []:
            for entry_id, fields in entries:
                self._last = entry_id
                out.append(fields.get(self.field.encode(), b""))
        return out

    async def close(self) -> None:
        if self._r is not None:
            await self._r.aclose()
