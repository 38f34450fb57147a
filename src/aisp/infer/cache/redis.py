"""A response cache's answers in Redis, shared by the workers that name the same namespace.

Under ``NS``: ``NS:a:KEY`` holds an answer (with a TTL, ``PX``), the sorted set ``NS:lru`` each
key's last use (Redis ``TIME``), the hash ``NS:size`` its size and ``NS:bytes`` their sum; a store
runs one Lua script that writes the answers (not one larger than the bound on its own) and evicts
the least recently used keys while the sum is over the bound, so several writers keep one bound.
Answers that expired stay counted until they are evicted (the bound is then kept with room to
spare, never exceeded).

The Bloom filter is shared too: a store sets its keys' bits in the bitmap ``NS:bloom`` (the
filter's words, little-endian, so ``GET`` gives them back as they are laid out in memory), and
each worker reloads it at most every ``refresh_s`` and sets what it stores itself, so a row
whose key no worker stored costs no Redis lookup; a key stored by another worker within the last
``refresh_s`` may be turned away once (a lost hit, never a wrong answer). When the keys evicted
since the bitmap was last built outnumber those kept, the worker that notices builds it again
from ``NS:lru``.
"""

from __future__ import annotations

import threading
import time
from typing import Any
from urllib.parse import urlsplit

import numpy as np
import numpy.typing as npt

from aisp.errors import ConfigError
from aisp.secrets import mask

__all__ = ["RedisStore"]

_PUT = """
local ttl, maxb, prefix = ARGV[1], tonumber(ARGV[2]), ARGV[3]
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local added = 0
for i = 4, #ARGV, 2 do
  local k, blob = ARGV[i], ARGV[i + 1]
  if #blob <= maxb then
    local old = redis.call('HGET', KEYS[2], k)
    if old then added = added - tonumber(old) end
    redis.call('SET', prefix .. k, blob, 'PX', ttl)
    redis.call('ZADD', KEYS[1], now, k)
    redis.call('HSET', KEYS[2], k, #blob)
    added = added + #blob
  end
end
local total = redis.call('INCRBY', KEYS[3], added)
local evicted = 0
while total > maxb do
  local popped = redis.call('ZPOPMIN', KEYS[1], 1)
  if #popped == 0 then break end
  local k = popped[1]
  local size = tonumber(redis.call('HGET', KEYS[2], k) or '0')
  redis.call('HDEL', KEYS[2], k)
  redis.call('DEL', prefix .. k)
  total = redis.call('DECRBY', KEYS[3], size)
  evicted = evicted + 1
end
if evicted > 0 then redis.call('INCRBY', KEYS[4], evicted) end
return evicted
"""


_TOUCH = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
for i = 1, #ARGV do redis.call('ZADD', KEYS[1], 'XX', now, ARGV[i]) end
"""


def _client(url: str) -> Any:
    import redis

    parts = urlsplit(url)
    if parts.scheme != "redis" or not parts.hostname:
        raise ConfigError(f"a response cache in Redis needs redis://HOST:PORT[/DB], got {mask(url)!r}")
    db = int(parts.path.strip("/") or 0)
    return redis.Redis(host=parts.hostname, port=parts.port or 6379, db=db, socket_timeout=10)


class RedisStore:
    """Answers (bytes) by 64-bit key in Redis under ``namespace`` (see the module docstring),
    the Bloom filter ``bloom`` kept in step with the shared bitmap."""

    def __init__(
        self, url: str, namespace: str, max_bytes: int, ttl_s: float, bloom: Any, *, refresh_s: float = 1.0
    ) -> None:
        self._r = _client(url)
        self._ns, self.max_bytes, self.ttl_ms = namespace, max_bytes, max(1, int(ttl_s * 1000))
        self._bloom, self._refresh_s = bloom, refresh_s
        self._prefix = f"{namespace}:a:"
        self._keys = [f"{namespace}:lru", f"{namespace}:size", f"{namespace}:bytes", f"{namespace}:forgotten"]
        self._put, self._touch = self._r.register_script(_PUT), self._r.register_script(_TOUCH)
        self._refreshed = -float("inf")
        self._lock = threading.Lock()
        try:
            self._r.ping()
        except Exception as exc:  # redis's connection and auth errors
            raise ConfigError(f"response cache: cannot reach Redis at {mask(url)}: {exc}") from exc

    def refresh(self) -> None:
        """Reload the shared Bloom bitmap when it is older than ``refresh_s`` here."""
        now = time.monotonic()
        if now - self._refreshed < self._refresh_s:
            return
        with self._lock:
            self._refreshed = now
            raw = self._r.get(f"{self._ns}:bloom") or b""
            size = self._bloom.words.nbytes
            self._bloom.words[:] = np.frombuffer(raw[:size].ljust(size, b"\0"), dtype="<u8")

    def get(self, keys: list[int]) -> list[bytes | None]:
        """The answers of ``keys`` (None: none stored); the found ones' last use noted."""
        blobs: list[bytes | None] = self._r.mget([f"{self._prefix}{k}" for k in keys])
        used = [str(k) for k, b in zip(keys, blobs, strict=True) if b is not None]
        if used:  # for the least-recently-used order
            self._touch(keys=self._keys[:1], args=used)
        return blobs

    def put(self, keys: list[int], blobs: list[bytes]) -> int:
        """Store; the number of answers evicted (by this store) to stay under the bound."""
        args: list[Any] = [self.ttl_ms, self.max_bytes, self._prefix]
        for key, blob in zip(keys, blobs, strict=True):
            args += [str(key), blob]
        evicted = int(self._put(keys=self._keys, args=args))
        stored = np.array(keys, dtype=np.uint64)
        self._set_bits(stored)
        self._bloom.add(stored)
        if evicted and int(self._r.get(self._keys[3]) or 0) > len(self):
            self._rebuild()
        return evicted

    def _set_bits(self, keys: npt.NDArray[np.uint64]) -> None:
        if not len(keys):
            return
        pos = self._bloom.positions(keys).ravel().astype(np.int64)
        offsets = (pos & ~7) + 7 - (pos & 7)  # Redis numbers a byte's bits from the top
        cmd: list[Any] = []
        for off in np.unique(offsets).tolist():
            cmd += ["SET", "u1", off, 1]
        self._r.execute_command("BITFIELD", f"{self._ns}:bloom", *cmd)

    def _rebuild(self) -> None:
        """Build the shared bitmap again from the keys kept (see the module docstring)."""
        kept = np.array([int(k) for k in self._r.zrange(self._keys[0], 0, -1)], dtype=np.uint64)
        with self._lock:
            self._bloom.clear()
            self._bloom.add(kept)
            pipe = self._r.pipeline(transaction=True)
            pipe.set(f"{self._ns}:bloom", self._bloom.words.astype("<u8").tobytes())
            pipe.set(self._keys[3], 0)
            pipe.execute()

    def __len__(self) -> int:
        return int(self._r.zcard(self._keys[0]))

    @property
    def bytes(self) -> int:
        return int(self._r.get(self._keys[2]) or 0)

    def clear(self) -> None:
        """Drop every answer and the filter of this namespace."""
        cursor = 0
        while True:
            cursor, found = self._r.scan(cursor, match=f"{self._prefix}*", count=1000)
            if found:
                self._r.delete(*found)
            if not cursor:
                break
        self._r.delete(*self._keys, f"{self._ns}:bloom")

    def close(self) -> None:
        self._r.close()
