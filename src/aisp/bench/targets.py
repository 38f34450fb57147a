"""What ``aisp bench`` loads, from its TARGET argument."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from aisp.bench.broker import JetStreamTarget, RedisStreamsTarget
from aisp.bench.load import GrpcPipeline, HttpPipeline
from aisp.errors import ConfigError

__all__ = ["make_target"]


def make_target(target: str) -> Any:
    """A network target (HTTP, gRPC, a Redis stream pair), or the path of a local pipeline file
    (returned as is)."""
    if target.startswith(("http://", "https://")):
        return HttpPipeline(target)
    if target.startswith("grpc://"):
        return GrpcPipeline(target)
    if target.startswith("redis://"):
        return RedisStreamsTarget(target)
    if target.startswith("nats://"):
        return JetStreamTarget(target)
    if target.endswith(".py") and Path(target).is_file():
        return target
    raise ConfigError(
        "bench target must be http(s)://…, grpc://HOST:PORT/PIPELINE, redis:// or nats://HOST:PORT/IN?output=OUT"
        f" or a pipeline file, got {target!r}"
    )
