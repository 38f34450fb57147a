"""NATS JetStream sink: each row published with a ``Nats-Msg-Id``, so the stream drops duplicates.

Rows are published as JSON (the same line as the file sink) to ``subject``, each with the
header ``Nats-Msg-Id: {subject}:{engine id}``, and every publish waits for its stream ack. When
a restored pipeline replays the events after its checkpoint, JetStream recognises their ids
within the stream's duplicate window and stores each output once. The stream is created (with
``duplicate_window_s``) if it does not exist. One output row per event is assumed (the id is the
engine id); a replay later than the duplicate window after the first write is not deduplicated.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from aisp.aio import LoopThread
from aisp.batch import Batch
from aisp.connectors.access import Access
from aisp.connectors.nats.client import connect_nats
from aisp.errors import SinkError
from aisp.retry import call_with_retry
from aisp.sinks.base import RowEncoder, Sink, SinkPartition

__all__ = ["JetStreamSink", "ensure_stream"]


async def ensure_stream(js: Any, config: Any) -> None:
    """Create the JetStream stream ``config`` describes unless it exists (also when someone else
    creates it between the lookup and the create: then theirs is used)."""
    import nats

    try:
        await js.stream_info(config.name)
    except nats.js.errors.NotFoundError:
        try:
            await js.add_stream(config)
        except nats.js.errors.BadRequestError:  # created meanwhile
            await js.stream_info(config.name)


@dataclass(frozen=True, kw_only=True)
class JetStreamSink(Sink):
    """Publishes rows to ``subject`` of JetStream ``stream`` once each (see module docstring)."""

    stream: str
    subject: str | None = None
    """Default: ``{stream}.out``."""
    servers: str = "nats://127.0.0.1:4222"
    columns: Sequence[str] | None = None
    duplicate_window_s: float = 3600.0
    retry_s: float = 30.0
    access: Access = Access()
    """Credentials, TLS, a creds file (``aisp.connectors.access``)."""
    ack_timeout_s: float = 2.0
    """How long one publish waits for its stream ack before it is retried."""

    def open(self) -> SinkPartition:
        return _JetStreamWriter(self)

    def describe(self) -> str:
        return f"{self.servers}/{self.stream}?subject={self.subject or self.stream + '.out'}"


class _JetStreamWriter(SinkPartition):
    def __init__(self, cfg: JetStreamSink) -> None:
        self._cfg = cfg
        self._subject = cfg.subject or f"{cfg.stream}.out"
        self._encoder = RowEncoder(cfg.columns)
        self._aio = LoopThread("aisp-nats-sink")
        self.duplicates = 0
        self._aio.start(
            self._connect(), cfg.retry_s + 5, SinkError, f"JetStream stream {cfg.stream!r} at {cfg.servers}"
        )

    async def _connect(self) -> None:
        from nats.js.api import StreamConfig

        cfg = self._cfg
        self._nc = await connect_nats(cfg.servers, cfg.access)
        self._js = self._nc.jetstream()
        await ensure_stream(
            self._js,
            StreamConfig(name=cfg.stream, subjects=[self._subject], duplicate_window=cfg.duplicate_window_s),
        )

    async def _publish(
        self, ids: Sequence[object], lines: Sequence[bytes], traceparents: Mapping[Any, str]
    ) -> int:
        subject = self._subject

        def headers(i: object) -> dict[str, str]:
            h = {"Nats-Msg-Id": f"{subject}:{i}"}
            if i in traceparents:
                h["traceparent"] = traceparents[i]
            return h

        acks = await asyncio.gather(
            *(
                self._js.publish(subject, line, headers=headers(i), timeout=self._cfg.ack_timeout_s)
                for i, line in zip(ids, lines, strict=False)
            )
        )
        return sum(1 for a in acks if a.duplicate)

    def write(self, batch: Batch) -> None:
        """Publish the rows; a failed publish is retried (the same ``Nats-Msg-Id``, so never
        stored twice) with backoff and full jitter until ``retry_s`` has passed."""
        if batch.num_rows:
            lines = self._encoder.encode(batch).split(b"\n")[: batch.num_rows]
            self.write_lines(batch.ids.tolist(), lines, batch.traceparents)

    def write_lines(
        self, ids: Sequence[object], lines: Sequence[bytes], traceparents: Mapping[Any, str] | None = None
    ) -> None:
        """Publish ``lines`` (JSON) with ``Nats-Msg-Id`` ``{subject}:{id}`` (and the
        ``traceparent`` of ids in ``traceparents``)."""
        cfg = self._cfg
        traced = traceparents or {}
        self.duplicates += call_with_retry(
            lambda: self._aio.run(self._publish(ids, lines, traced), timeout_s=cfg.ack_timeout_s + 5),
            retry_on=(Exception,),
            give_up_after_s=cfg.retry_s,
            what=f"JetStream at {cfg.servers} (publishing to {self._subject!r})",
            error=SinkError,
        )

    def close(self) -> None:
        self._aio.close(self._nc)
