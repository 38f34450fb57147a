"""Redis Streams sink with idempotent writes: each event's output is added to the stream once.

Rows are written as JSON (the same line as the file sink) in a field (``data``) of a new stream
entry. Every row goes through one server-side script call per chunk that sets an idempotency
key ``{dedupe_prefix}{engine id}`` with ``SET NX EX dedupe_ttl_s`` and adds the entry only if the
key was new; so when a restored pipeline replays the events after its checkpoint, their outputs
are not added a second time, and readers never see a duplicate. This assumes one output row per
event (the engine id is the key) and a single Redis node. Lost connections are retried with
exponential backoff and full jitter for ``retry_s`` seconds, then the sink fails clearly.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from aisp.batch import Batch
from aisp.connectors.access import Access
from aisp.connectors.redis.client import call_redis, final_reason, redis_client
from aisp.errors import SinkError
from aisp.sinks.base import RowEncoder, Sink, SinkPartition

__all__ = ["RedisStreamSink"]

_ADD_ONCE = """
local added = 0
for i = 3, #ARGV, 2 do
  if redis.call('SET', KEYS[2] .. ARGV[i], '1', 'NX', 'EX', tonumber(ARGV[2])) then
    redis.call('XADD', KEYS[1], '*', ARGV[1], ARGV[i + 1])
    added = added + 1
  end
end
return added
"""
_ADD_ONCE_TRACED = """
local added = 0
for i = 3, #ARGV, 3 do
  if redis.call('SET', KEYS[2] .. ARGV[i], '1', 'NX', 'EX', tonumber(ARGV[2])) then
    redis.call('XADD', KEYS[1], '*', ARGV[1], ARGV[i + 1], 'traceparent', ARGV[i + 2])
    added = added + 1
  end
end
return added
"""


@dataclass(frozen=True, kw_only=True)
class RedisStreamSink(Sink):
    """Adds each row to ``stream`` at ``host:port`` once (see the module docstring)."""

    stream: str
    host: str = "127.0.0.1"
    port: int = 6379
    field: str = "data"
    columns: Sequence[str] | None = None
    dedupe_ttl_s: int = 7 * 24 * 3600
    dedupe_prefix: str | None = None
    """Key prefix of the idempotency keys (default ``aisp:dedupe:{stream}:``)."""
    chunk_rows: int = 1000
    retry_s: float = 30.0
    access: Access = Access()
    """Credentials and TLS (``aisp.connectors.access``)."""

    def open(self) -> SinkPartition:
        return _RedisStreamWriter(self)

    def describe(self) -> str:
        return f"redis://{self.host}:{self.port}/{self.stream}"


class _RedisStreamWriter(SinkPartition):
    def __init__(self, cfg: RedisStreamSink) -> None:
        import redis

        self._cfg = cfg
        self._errors = (redis.ConnectionError, redis.TimeoutError)
        self._r: Any = redis_client(cfg.host, cfg.port, cfg.access, socket_timeout=10)
        self._script = self._r.register_script(_ADD_ONCE)
        self._traced_script = self._r.register_script(_ADD_ONCE_TRACED)
        self._prefix = cfg.dedupe_prefix or f"aisp:dedupe:{cfg.stream}:"
        self._encoder = RowEncoder(cfg.columns)
        self.added = 0
        self.skipped = 0
        # asked at open: a refused login stops a run (or `aisp serve`) at its start, not at its
        # first output or dead letter; a server that is away is waited for by the first write
        try:
            self._r.ping()
        except (*self._errors, redis.ResponseError) as exc:
            reason = final_reason(exc)
            if reason is not None:
                raise SinkError(f"redis at {cfg.host}:{cfg.port}: {reason}: {exc}") from exc

    def write(self, batch: Batch) -> None:
        if batch.num_rows:
            lines = self._encoder.encode(batch).split(b"\n")
            self.write_lines(batch.ids.tolist(), lines, batch.traceparents)

    def write_lines(
        self, keys: Sequence[object], lines: Sequence[bytes], traceparents: Mapping[Any, str] | None = None
    ) -> None:
        """Add ``lines`` (JSON), each once per idempotency key in ``keys``; entries of keys in
        ``traceparents`` also get a ``traceparent`` field."""
        cfg = self._cfg
        traced = traceparents or {}
        for start in range(0, len(keys), cfg.chunk_rows):
            args: list[Any] = [cfg.field, cfg.dedupe_ttl_s]
            marked: list[Any] = [cfg.field, cfg.dedupe_ttl_s]
            for i in range(start, min(start + cfg.chunk_rows, len(keys))):
                if keys[i] in traced:
                    marked += [keys[i], lines[i], traced[keys[i]]]
                else:
                    args += [keys[i], lines[i]]
            for script, fields, chunk in ((self._script, 2, args), (self._traced_script, 3, marked)):
                if len(chunk) > 2:
                    added = int(self._call(script, [cfg.stream, self._prefix], chunk))
                    self.added += added
                    self.skipped += (len(chunk) - 2) // fields - added

    def _call(self, fn: Any, *args: Any) -> Any:
        cfg = self._cfg
        return call_redis(
            fn, *args, retry_on=self._errors, retry_s=cfg.retry_s, what=f"redis at {cfg.host}:{cfg.port}",
            error=SinkError,
        )  # fmt: skip

    def close(self) -> None:
        self._r.close()
