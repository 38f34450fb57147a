"""What ``aisp bench`` loads, from its TARGET argument."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from aisp.bench.broker import BrokerTarget
from aisp.bench.load import GrpcPipeline, HttpPipeline
from aisp.connectors import schemes
from aisp.connectors.url import scheme_of
from aisp.errors import ConfigError

__all__ = ["make_target"]


def make_target(target: str) -> Any:
    """A network target (HTTP, gRPC, a Redis stream pair), or the path of a local pipeline file
    (returned as is)."""
    if target.startswith(("http://", "https://")):
        return HttpPipeline(target)
    if target.startswith("grpc://"):
        return GrpcPipeline(target)
    if target.endswith(".py") and Path(target).is_file():
        return target
    if "://" in target and scheme_of(target) in schemes():
        return BrokerTarget(target)  # a connector with a load client: SCHEME://HOST:PORT/IN?output=OUT
    raise ConfigError(
        "bench target must be http(s)://…, grpc://HOST:PORT/PIPELINE, a broker (redis:// or"
        f" nats://HOST:PORT/IN?output=OUT) or a pipeline file, got {target!r}"
    )
