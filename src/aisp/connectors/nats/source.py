"""NATS JetStream source: a durable pull consumer, acknowledged once a checkpoint covers a message.

Each message carries one event as JSON, decoded with the pipeline's schema; a message that does
not parse is dead-lettered with its stream sequence and the reason, and acknowledged with the
rest. The engine id of an event is its stream sequence, so a replay gives the same ids.

Delivery: the durable consumer ``durable`` on ``stream`` (filtered by ``subject`` if given) uses
``AckPolicy.ALL``; the position is the stream sequence of the last message handed to the
pipeline, and ``commit(position)`` acknowledges up to it once the checkpoint holding it is
durable. On a restart from a checkpoint the consumer is recreated to start right after the
checkpointed sequence, so the messages after it are delivered again at once (not after the ack
wait): exactly-once together with checkpoints and a deduplicating sink. Without a checkpoint an
existing consumer is recreated to start after its acknowledged floor (at-least-once). Lost connections are
retried by the client; a call that keeps failing for ``retry_s`` stops the source with a clear
error. Messages the server delivered into a reply lost in a disconnect are delivered again: a
gap in the consumer sequence shows them at once, and a quiet consumer asks the server every
half second (and before the input ends idle) whether it delivered more than arrived.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any, ClassVar, TypeVar

import msgspec
import numpy as np

from aisp.aio import LoopThread
from aisp.batch import Batch
from aisp.connectors.access import Access
from aisp.connectors.nats.client import connect_nats
from aisp.errors import SourceError
from aisp.ingest.base import IdleClock, Source, SourceContext, SourcePartition
from aisp.ingest.messages import MessageDecoder
from aisp.retry import call_with_retry

__all__ = ["JetStreamSource"]

T = TypeVar("T")
_CHECK_S = 0.5
"""How often a quiet consumer asks the server whether a delivery was lost."""


@dataclass(frozen=True, kw_only=True)
class JetStreamSource(Source):
    """Reads JetStream ``stream`` with durable pull consumer ``durable`` (see module docstring)."""

    stream: str
    schema: type[msgspec.Struct]
    servers: str = "nats://127.0.0.1:4222"
    durable: str = "aisp"
    subject: str | None = None
    fetch_timeout_s: float = 0.1
    max_ack_pending: int = 1_000_000
    retry_s: float = 30.0
    access: Access = Access()
    """Credentials, TLS, a creds file (``aisp.connectors.access``)."""
    stop_when_idle_s: float | None = None
    """End the input after this long without a new message (None: read for ever)."""
    decode_heavy: ClassVar[bool] = False

    def open(self, ctx: SourceContext, resume_from: Any = None) -> SourcePartition:
        return _JetStreamPartition(self, ctx, resume_from)

    def describe(self) -> str:
        return f"{self.servers}/{self.stream}?durable={self.durable}"


class _JetStreamPartition(SourcePartition):
    def __init__(self, cfg: JetStreamSource, ctx: SourceContext, resume_from: Any) -> None:
        self._cfg, self._ctx = cfg, ctx
        self._aio = LoopThread(f"aisp-nats-{ctx.step_id}")
        self._messages = MessageDecoder(cfg.schema, ctx)
        self._empty = self._messages.empty  # nothing new yet
        self._last: int | None = int(resume_from["seq"]) if resume_from else None
        self._unacked: dict[int, Any] = {}  # stream seq -> message, the newest of each batch
        self._idle = IdleClock()
        self._sub: Any = None
        self._start: int | None = None
        self._checked = time.monotonic()
        self._delivered = 0
        what = f"JetStream stream {cfg.stream!r} at {cfg.servers}"
        self._aio.start(self._connect(), cfg.retry_s + 5, SourceError, what)

    async def _connect(self) -> None:
        cfg = self._cfg
        self._nc = await connect_nats(cfg.servers, cfg.access)
        self._js = self._nc.jetstream()
        await self._js.stream_info(cfg.stream)  # fails clearly if the stream does not exist
        await self._subscribe(None if self._last is None else self._last + 1)

    async def _subscribe(self, start: int | None) -> None:
        """(Re)create the durable consumer to deliver from stream sequence ``start`` (None: after
        its ack floor): what an earlier run, or a delivery lost in a disconnect, was handed but
        never acknowledged comes again at once and in order, not after the ack wait. Safe to
        call again after a failure part-way (a reply lost in a disconnect)."""
        import nats

        cfg, js = self._cfg, self._js
        if self._sub is not None:
            sub, self._sub = self._sub, None
            await sub.unsubscribe()
        if start is None:
            try:
                info = await js.consumer_info(cfg.stream, cfg.durable)
                start = info.ack_floor.stream_seq + 1 if info.ack_floor else 1
            except nats.js.errors.NotFoundError:
                start = 1
        self._start = start  # a retry after this point keeps it (the consumer may be gone)
        try:
            await js.delete_consumer(cfg.stream, cfg.durable)
        except nats.js.errors.NotFoundError:
            pass
        self._sub = await js.pull_subscribe(
            cfg.subject or "", durable=cfg.durable, stream=cfg.stream, config=self._consumer_config(start)
        )
        self._delivered = 0  # consumer sequence of the last message received
        self._checked = time.monotonic()

    def _consumer_config(self, start: int) -> Any:
        from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

        cfg = self._cfg
        config = ConsumerConfig(
            durable_name=cfg.durable,
            ack_policy=AckPolicy.ALL,
            filter_subject=cfg.subject,
            max_ack_pending=cfg.max_ack_pending,  # acks wait for checkpoints: allow many
        )
        if start > 1:
            config.deliver_policy = DeliverPolicy.BY_START_SEQUENCE
            config.opt_start_seq = start
        return config

    def _resubscribe(self) -> None:
        """Deliver again from the message after the last one handed out (or the ack floor)."""
        start = self._start if self._last is None else self._last + 1
        self._call(lambda: self._subscribe(start))

    def _call(self, coro: Callable[[], Coroutine[Any, Any, T]]) -> T:
        """Run ``coro()`` on the client's loop, retried while the broker is unreachable (a lost
        reply is a timeout) for up to ``retry_s``."""
        import nats

        cfg = self._cfg
        return call_with_retry(
            lambda: self._aio.run(coro(), timeout_s=cfg.retry_s),
            retry_on=(ConnectionError, OSError, TimeoutError, nats.errors.Error),
            give_up_after_s=cfg.retry_s,
            what=f"JetStream at {cfg.servers}",
            error=SourceError,
        )

    async def _lost_deliveries(self) -> bool:
        """Whether the server delivered messages this consumer never received (a reply lost in a
        disconnect when nothing came after it to show the gap) or still holds undelivered ones
        although fetches come back empty."""
        info = await self._js.consumer_info(self._cfg.stream, self._cfg.durable)
        return bool(info.delivered.consumer_seq > self._delivered or info.num_pending)

    async def _fetch(self, n: int) -> list[Any]:
        import nats

        try:
            return list(await self._sub.fetch(n, timeout=self._cfg.fetch_timeout_s))
        except nats.errors.TimeoutError:
            return []

    def next_batch(self, max_rows: int) -> Batch | None:
        msgs = self._call(lambda: self._fetch(max_rows))
        delivered = [m.metadata.sequence.consumer for m in msgs]
        if delivered != list(range(self._delivered + 1, self._delivered + 1 + len(msgs))):
            # a delivery was lost (a disconnect mid-fetch): deliver again from the last message
            # handed out, in order, instead of acking past the hole
            self._resubscribe()
            return self._empty
        if msgs:
            self._delivered = delivered[-1]
        if self._last is not None:  # redelivered after the ack wait: already handed out
            msgs = [m for m in msgs if m.metadata.sequence.stream > self._last]
        if not msgs:
            return self._nothing_new()
        self._idle.handed_out()
        seqs = [m.metadata.sequence.stream for m in msgs]
        self._last = seqs[-1]
        self._unacked[seqs[-1]] = msgs[-1]
        return self._messages.batch(
            [m.data for m in msgs],
            np.asarray(seqs, dtype=np.int64),
            lambda i: {"stream_seq": seqs[i]},
            [(m.headers or {}).get("traceparent") for m in msgs] if any(m.headers for m in msgs) else None,
        )

    def _nothing_new(self) -> Batch | None:
        """An empty fetch: nothing new yet, a delivery lost with nothing after it to show the gap
        (checked every ``_CHECK_S`` of quiet: delivered again), or the end of the input."""
        now = time.monotonic()
        if not self._nc.is_connected:
            self._idle.reset()  # a broker away is not the end of the input
            return self._empty
        quiet = self._idle.idle_s()
        idle = self._cfg.stop_when_idle_s
        ending = idle is not None and quiet >= idle
        if (ending or (quiet >= _CHECK_S and now - self._checked >= _CHECK_S)) and self._call(
            self._lost_deliveries
        ):
            self._resubscribe()
            self._idle.reset()
            return self._empty
        self._checked = now
        return None if ending else self._empty

    def snapshot(self) -> Any:
        return {"seq": self._last} if self._last is not None else None

    def commit(self, position: Any) -> None:
        """Acknowledge (AckPolicy.ALL) every message up to the checkpointed sequence."""
        if not position:
            return
        seq = int(position["seq"])
        covered = [s for s in list(self._unacked) if s <= seq]
        if not covered:
            return
        newest = self._unacked[max(covered)]
        for s in covered:
            self._unacked.pop(s, None)
        try:
            self._aio.run(newest.ack(), timeout_s=10)
        except Exception:  # noqa: BLE001 - acks are redone by the next checkpoint's replay point
            return

    def close(self) -> None:
        self._aio.close(self._nc)
