"""The ``llm`` step: each row's prompt streamed through an LLM (``OpenAIClient``), token by token.

Rows queue in the step by tier (higher first) for a free slot of the client's endpoints. Each
generation's pieces of text go downstream as they come, as *partial* rows (meta columns, the
``_partial`` flag and the ``token`` column), pieces that arrive together in one batch, and
then the row itself with the whole answer and its timings: ``answer``, ``finish_reason``,
``completion_tokens``, ``ttft_ms`` (from the event's ingest: the steps before and the queueing here
included),
``queue_ms``, ``tokens_per_s``, ``jitter`` (stdev/mean of its gaps between pieces) and
``endpoint``. A row whose generation fails goes to the dead letters with the cause.

Admission keeps the time to first token (TTFT, from the event's ingest) under
``LlmSlo.ttft_ms``: from the time the event has spent (or recently took) reaching the step, the
requests running (their expected ends), those queued ahead, and the recent generation times and
times to a first token (p90), it predicts each event's TTFT; one that would miss the target is
not queued. A higher-tier arrival takes the place of the lowest-tier request queued (which is shed),
a served pipeline refuses the request before it starts (``refusal``: 429 with ``Retry-After``),
and a request that waited past the target anyway is shed before it starts. ``LlmSlo.jitter``
bounds the gaps' jitter: while recent requests' jitter is over it, the step runs fewer
generations at a time (down to one), and more again once it is well under.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa

from aisp.batch import ID, INGEST_NS, PARTIAL, TIER, Batch
from aisp.errors import ConfigError
from aisp.infer.llm import Generation, LlmClient, LlmError
from aisp.observe.latency import LatencyHistogram

__all__ = ["LlmSlo", "LlmSpec", "LlmStage", "LlmStats"]

log = logging.getLogger("aisp.llm")

_MS = 1_000_000
_PIECE_COLUMNS = [ID, INGEST_NS, "token", PARTIAL]


@dataclass(frozen=True, kw_only=True)
class LlmSlo:
    """Targets admission enforces (None: not enforced)."""

    ttft_ms: float | None = None
    """Time to first token at p99, from the event's ingest: what its client waits, the steps
    before this one and the queueing here included."""
    jitter: float | None = None
    """Jitter of the gaps between pieces (stdev / mean), averaged over recent requests."""
    margin: float = 0.9
    """Admit only when the predicted TTFT is within this share of the target."""
    window: int = 32
    """Recent requests the estimates and the jitter control look at."""


@dataclass(frozen=True, kw_only=True)
class LlmSpec:
    """What an ``llm`` step runs: ``client`` (an ``OpenAIClient``, or a ``LocalLlama`` in this
    process) on the prompts in column ``prompt``.

    ``tokens`` False: no partial rows, only each row with its answer. ``max_queue`` bounds the
    requests waiting for a slot (beyond it the lowest tier is shed)."""

    client: LlmClient
    prompt: str = "prompt"
    output: str = "answer"
    tokens: bool = True
    slo: LlmSlo = field(default_factory=LlmSlo)
    max_queue: int = 1024

    def __post_init__(self) -> None:
        if self.max_queue < 1:
            raise ConfigError(f"max_queue must be >= 1, got {self.max_queue}")


class LlmStats:
    """What an ``llm`` step measured (nanosecond histograms; counts since start)."""

    def __init__(self, window: int) -> None:
        self.ttft = LatencyHistogram()
        """Arrival at the step -> first piece."""
        self.first_token = LatencyHistogram()
        """Request sent -> first piece: the server's share of the TTFT."""
        self.queue = LatencyHistogram()
        self.inter_token = LatencyHistogram()
        self.generation = LatencyHistogram()
        """Request sent -> last piece."""
        self.requests = self.completed = self.failed = self.retries = self.tokens = 0
        self.shed: dict[str, int] = {}
        self.refused = 0
        """Rows a served pipeline refused before they reached the step (``refusal``)."""
        self.recent_jitter: deque[float] = deque(maxlen=window)
        self.recent_generation_ns: deque[int] = deque(maxlen=window)
        self.recent_first_ns: deque[int] = deque(maxlen=window)
        self.recent_upstream_ns: deque[int] = deque(maxlen=window)
        """Ingest -> arrival at the step: the time the steps before it take."""
        self.recent_rates: deque[float] = deque(maxlen=window)

    @property
    def jitter(self) -> float:
        """Mean jitter (stdev / mean of the gaps) of recent requests; 0.0 before any."""
        j = list(self.recent_jitter)
        return float(np.mean(j)) if j else 0.0

    @property
    def tokens_per_s(self) -> float:
        """Mean streaming rate of recent requests (pieces per second after the first)."""
        r = list(self.recent_rates)
        return float(np.mean(r)) if r else 0.0

    def shed_one(self, reason: str) -> None:
        self.shed[reason] = self.shed.get(reason, 0) + 1


class _Request:
    __slots__ = ("arrived_ns", "born_ns", "event_id", "gaps", "last_ns", "pieces", "prompt", "row", "seq",
                 "tier")  # fmt: skip

    def __init__(
        self, row: Batch, prompt: str, tier: int, arrived_ns: int, born_ns: int, event_id: int, seq: int
    ) -> None:
        self.row, self.prompt, self.tier, self.arrived_ns, self.seq = row, prompt, tier, arrived_ns, seq
        self.born_ns, self.event_id = born_ns, event_id  # the event's ingest time and id
        self.pieces = 0
        self.last_ns = 0
        self.gaps: list[int] = []


Emit = Callable[[Batch], None]


class LlmStage:
    """Runs an ``LlmSpec`` on its own event loop thread (see the module docstring).

    ``emit`` takes rows that replace rows fed in (one out per in), ``emit_made`` partial rows
    (new rows), ``dead_letter(batch, reason)`` rows that leave here."""

    def __init__(
        self,
        spec: LlmSpec,
        *,
        emit: Emit,
        emit_made: Emit,
        dead_letter: Callable[[Batch, str], None],
        clock: Callable[[], int] = time.monotonic_ns,
    ) -> None:
        self.spec, self.client = spec, spec.client
        self._emit, self._emit_made, self._dead_letter, self._clock = emit, emit_made, dead_letter, clock
        self.stats = LlmStats(spec.slo.window)
        self.limit = spec.client.capacity
        """Generations at a time: the client's capacity, fewer while jitter is over its target."""
        self._queues: dict[int, deque[_Request]] = {}
        self._queued = 0
        self._running: dict[int, int] = {}  # seq -> sent_ns
        self._seq = 0
        self._feeding = 0  # rows fed, not yet on the loop
        self._reserved: deque[int] = deque()  # when each request ``refusal`` admitted stops counting
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._idle: asyncio.Event | None = None
        self._pieces: list[tuple[_Request, str]] = []
        self._tasks: set[asyncio.Task[None]] = set()

    # -- the executor's side --------------------------------------------------------------------
    @property
    def queued_rows(self) -> int:
        return self._queued + self._feeding

    @property
    def running(self) -> int:
        return len(self._running)

    def feed(self, batch: Batch) -> None:
        if not batch.num_rows:
            return
        loop = self._start()
        with self._lock:
            self._feeding += batch.num_rows
        loop.call_soon_threadsafe(self._arrive, batch)

    def close(self) -> None:
        """Wait for every fed row's generation to end (its rows emitted), then stop the loop."""
        loop, thread = self._loop, self._thread
        if loop is None or thread is None:
            return
        asyncio.run_coroutine_threadsafe(self._drain(), loop).result()
        loop.call_soon_threadsafe(loop.stop)
        thread.join()
        loop.close()
        self._loop = self._thread = None

    def _start(self) -> asyncio.AbstractEventLoop:
        with self._lock:
            if self._loop is None:
                loop = asyncio.new_event_loop()
                self._thread = threading.Thread(target=loop.run_forever, name="aisp-llm", daemon=True)
                self._thread.start()
                self._loop = loop
            return self._loop

    async def _drain(self) -> None:
        while self._queued or self._running or self._feeding:
            self._idle = asyncio.Event()
            await self._idle.wait()
        await self.client.aclose()
        await asyncio.get_running_loop().shutdown_asyncgens()

    # -- admission --------------------------------------------------------------------------------
    def predict_ttft_ns(self, ahead: int, elapsed_ns: int | None = None) -> int | None:
        """The TTFT of an event with ``ahead`` requests before it (queued or on their way) and
        ``elapsed_ns`` since its ingest (None: one not yet through the steps before this one,
        which recently took their p90); None while nothing has been measured."""
        gen, first = self.stats.recent_generation_ns, self.stats.recent_first_ns
        if not gen or not first:
            return None
        service = int(np.percentile(list(gen), 90))
        first_ns = int(np.percentile(list(first), 90))
        if elapsed_ns is None:
            upstream = list(self.stats.recent_upstream_ns)
            elapsed_ns = int(np.percentile(upstream, 90)) if upstream else 0
        now = self._clock()
        limit = max(1, self.limit)
        ends = sorted(max(0, service - (now - sent)) for sent in list(self._running.values()))
        ends = ([0] * max(0, limit - len(ends)) + ends)[:limit]
        wait = ends[ahead % limit] + (ahead // limit) * service
        return elapsed_ns + wait + first_ns

    def _ahead(self) -> int:
        """Requests a new arrival would wait behind (beyond the free slots)."""
        now = self._clock()
        with self._lock:
            while self._reserved and self._reserved[0] < now:
                self._reserved.popleft()
            reserved = len(self._reserved)
        return max(0, self._queued + self._feeding + reserved + len(self._running) - self.limit)

    def _over(self, ahead: int, elapsed_ns: int | None = None) -> tuple[int, int] | None:
        """(predicted, target) in ns when an event ``ahead`` would miss its TTFT target."""
        target = self.spec.slo.ttft_ms
        if target is None:
            return None
        predicted = self.predict_ttft_ns(ahead, elapsed_ns)
        if predicted is None:  # nothing measured yet: only as many as run at once may wait
            return (int(target * _MS) + 1, int(target * _MS)) if ahead >= self.limit else None
        allowed = int(target * self.spec.slo.margin * _MS)
        return (predicted, int(target * _MS)) if predicted > allowed else None

    def refusal(self, rows: int) -> tuple[float, str] | None:
        """(retry after seconds, why) when a request of ``rows`` events would miss the TTFT
        target; None admits it, and it counts as one request on its way for a second (a served
        pipeline's admission, before the rows start through the pipeline, where some may not
        reach this step: a request counts as one, whatever its rows)."""
        over = self._over(self._ahead())
        if over is None:
            with self._lock:
                self._reserved.append(self._clock() + 1_000_000_000)
            return None
        self.stats.refused += rows
        predicted, target = over
        return max(0.05, (predicted - target) / 1e9), _over_target(predicted, target)

    # -- the loop's side --------------------------------------------------------------------------
    def _arrive(self, batch: Batch) -> None:
        n = batch.num_rows
        now = self._clock()
        with self._lock:
            self._feeding -= n
            for _ in range(min(n, len(self._reserved))):  # admitted rows no longer on their way
                self._reserved.popleft()
        prompts = batch.pylist(self.spec.prompt)
        tiers = batch.meta(TIER).tolist()
        born, ids = batch.numpy(INGEST_NS).tolist(), batch.ids.tolist()
        self.stats.requests += n
        for i, (prompt, tier) in enumerate(zip(prompts, tiers, strict=True)):
            self._seq += 1
            text = "" if prompt is None else str(prompt)
            req = _Request(batch.slice(i, 1), text, tier, now, born[i], ids[i], self._seq)
            self.stats.recent_upstream_ns.append(max(0, now - born[i]))
            self._admit(req)
        self._pump()

    def _admit(self, req: _Request) -> None:
        ahead = max(0, self._queued + len(self._running) - self.limit)
        over = self._over(ahead, self._clock() - req.born_ns)
        full = self._queued >= self.spec.max_queue
        if over is None and not full:
            self._enqueue(req)
            return
        lowest = min((t for t, q in self._queues.items() if q), default=None)
        if lowest is not None and lowest < req.tier:  # a higher tier takes the lowest one's place
            victim = self._queues[lowest].pop()
            self._queued -= 1
            self._shed(victim, f"shed for a higher tier (tier {req.tier} over {lowest})", "tier")
            self._enqueue(req)
            return
        if full:
            self._shed(req, f"the LLM step's queue is full ({self.spec.max_queue} requests)", "queue_full")
        else:
            self._shed(req, _over_target(*over), "ttft_slo")  # type: ignore[misc]

    def _enqueue(self, req: _Request) -> None:
        self._queues.setdefault(req.tier, deque()).append(req)
        self._queued += 1

    def _shed(self, req: _Request, reason: str, kind: str) -> None:
        self.stats.shed_one(kind)
        self._dead_letter(req.row, f"llm: {reason}")

    def _pump(self) -> None:
        """Start queued requests, highest tier first, while there are free slots."""
        target = self.spec.slo.ttft_ms
        while self._queued and len(self._running) < self.limit:
            tier = max(t for t, q in self._queues.items() if q)
            req = self._queues[tier].popleft()
            self._queued -= 1
            now = self._clock()
            if target is not None and now - req.born_ns > target * _MS:
                waited = (now - req.born_ns) / _MS
                self._shed(req, f"waited {waited:.0f} ms, past the TTFT target {target:.0f} ms", "waited")
                continue
            self.stats.queue.record_one(now - req.arrived_ns)
            self._running[req.seq] = self._clock()
            task = asyncio.get_running_loop().create_task(self._run(req))
            self._tasks.add(task)  # (the loop keeps only weak references to its tasks)
            task.add_done_callback(self._task_done)
        self._check_idle()

    def _task_done(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:  # (a fatal error downstream)
            log.error("llm step: a generation's task failed", exc_info=task.exception())

    def _check_idle(self) -> None:
        if self._idle is not None and not (self._queued or self._running or self._feeding):
            self._idle.set()

    async def _run(self, req: _Request) -> None:
        try:
            gen = await self.client.generate(req.prompt, lambda text: self._piece(req, text))
        except Exception as exc:  # noqa: BLE001 - the row goes to the dead letters, the step goes on
            if not isinstance(exc, LlmError):
                log.exception("llm step: a generation failed unexpectedly")
            self._flush()
            self.stats.failed += 1
            why = str(exc) if isinstance(exc, LlmError) else f"{type(exc).__name__}: {exc}"
            self._dead_letter(req.row, f"llm: {why}")
        else:
            self._flush()
            self._finished(req, gen)
        finally:
            self._running.pop(req.seq, None)
            self._pump()

    def _piece(self, req: _Request, text: str) -> None:
        now = self._clock()
        st = self.stats
        if req.pieces:
            gap = now - req.last_ns
            req.gaps.append(gap)
            st.inter_token.record_one(gap)
        else:
            st.ttft.record_one(now - req.born_ns)
        req.pieces += 1
        req.last_ns = now
        st.tokens += 1
        if self.spec.tokens:
            if not self._pieces:  # pieces that arrive in one turn of the loop go out together
                asyncio.get_running_loop().call_soon(self._flush)
            self._pieces.append((req, text))

    def _flush(self) -> None:
        pieces, self._pieces = self._pieces, []
        if not pieces:
            return
        arrays = [  # straight to Arrow: this runs once per token
            pa.array([r.event_id for r, _ in pieces], pa.int64()),
            pa.array([r.born_ns for r, _ in pieces], pa.int64()),
            pa.array([t for _, t in pieces], pa.string()),
            pa.array([True] * len(pieces), pa.bool_()),
        ]
        self._emit_made(Batch(pa.RecordBatch.from_arrays(arrays, names=_PIECE_COLUMNS)))

    def _finished(self, req: _Request, gen: Generation) -> None:
        st = self.stats
        st.completed += 1
        st.retries += gen.attempts - 1
        st.first_token.record_one(gen.first_ns - gen.sent_ns)
        st.generation.record_one(gen.done_ns - gen.sent_ns)
        st.recent_first_ns.append(gen.first_ns - gen.sent_ns)
        st.recent_generation_ns.append(gen.done_ns - gen.sent_ns)
        gaps = np.asarray(req.gaps, dtype=np.float64)
        jitter = float(gaps.std() / gaps.mean()) if gaps.size >= 2 and gaps.mean() > 0 else 0.0
        rate = gaps.size / (gaps.sum() / 1e9) if gaps.size and gaps.sum() > 0 else 0.0
        if gaps.size >= 2:
            st.recent_jitter.append(jitter)
            st.recent_rates.append(rate)
            self._control_jitter()
        cols: dict[str, Any] = {
            self.spec.output: [gen.text],
            "finish_reason": [gen.finish_reason],
            "completion_tokens": np.array([gen.completion_tokens], dtype=np.int64),
            "ttft_ms": [(gen.first_ns - req.born_ns) / _MS if gen.pieces else None],
            "queue_ms": [(gen.sent_ns - req.arrived_ns) / _MS],
            "tokens_per_s": [rate],
            "jitter": [jitter],
            "endpoint": [gen.endpoint],
        }
        self._emit(req.row.with_columns(cols))

    def _control_jitter(self) -> None:
        target, st = self.spec.slo.jitter, self.stats
        if target is None or len(st.recent_jitter) < max(4, (st.recent_jitter.maxlen or 0) // 4):
            return
        capacity = self.client.capacity
        if st.jitter > target and self.limit > 1:
            self.limit -= 1
            st.recent_jitter.clear()
        elif st.jitter < 0.7 * target and self.limit < capacity:
            self.limit += 1
            st.recent_jitter.clear()
        self.limit = min(self.limit, capacity)


def _over_target(predicted_ns: int, target_ns: int) -> str:
    return (
        f"predicted time to first token {predicted_ns / _MS:.0f} ms is over the target"
        f" {target_ns / _MS:.0f} ms"
    )
