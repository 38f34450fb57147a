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
``LlmSlo.ttft_ms`` at p99 (``aisp.infer.llm.admission``): from the time the event has spent (or
recently took) reaching the step, the requests running (their expected ends), those queued or on
their way ahead, and the recent generation times and times to a first token (their p99, each
counting for ``LlmSlo.memory_s``), it predicts each event's TTFT; one that would miss the target is
not queued, unless the step has been idle for ``LlmSlo.probe_ms`` (one is then admitted as a
probe, so the estimate learns again). A higher-tier arrival takes the place of the lowest-tier
request queued (which is shed), a served pipeline refuses the request before it starts
(``refusal``: 429 with a ``Retry-After`` after which the same request would be admitted), and a
queued request whose wait reaches the target is shed then (a timer, not the next free slot).
``LlmSlo.jitter`` bounds the gaps' jitter: while recent requests' jitter is over it, the step runs
fewer generations at a time (down to one), and more again once it is well under.
"""

from __future__ import annotations

import asyncio
import logging
import math
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
from aisp.infer.llm.admission import LlmSlo, Load, TtftPredictor
from aisp.infer.llm.client import Generation, LlmClient, LlmError
from aisp.observe.latency import LatencyHistogram

__all__ = ["LlmSlo", "LlmSpec", "LlmStage", "LlmStats"]

log = logging.getLogger("aisp.llm")

_MS = 1_000_000
_RESERVE_NS = 1_000_000_000  # how long an admitted request counts as on its way at most
_PIECE_COLUMNS = [ID, INGEST_NS, "token", PARTIAL]


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
        self.probes = 0
        """Requests admitted as probes (the step idle, whatever the prediction)."""
        self.recent_jitter: deque[float] = deque(maxlen=window)
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
        self.predictor = TtftPredictor(spec.slo)
        self._reserved: dict[int, tuple[int, int, int]] = {}  # key -> (first id, end id, until ns)
        self._unkeyed = 0  # keys of admissions without event ids (-1, -2, ...)
        self._last_end_ns: int | None = None  # when the last generation ended
        self._sweep: asyncio.TimerHandle | None = None
        self._sweep_at = 0
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
        if self._sweep is not None:
            self._sweep.cancel()
            self._sweep = None
        await self.client.aclose()
        await asyncio.get_running_loop().shutdown_asyncgens()

    # -- admission --------------------------------------------------------------------------------
    def _load(self, now: int, *, on_the_way: bool) -> Load:
        """What the step is doing at ``now``: with ``on_the_way``, the rows fed and the requests
        admitted (``refusal``) that have not come yet count as waiting."""
        waiting, until = self._queued, tuple[int, ...]()
        if on_the_way:
            with self._lock:
                for key in [k for k, (_, _, u) in self._reserved.items() if u <= now]:
                    del self._reserved[key]
                until = tuple(u for _, _, u in self._reserved.values())
                waiting += self._feeding + len(until)
        running = tuple(self._running.values())
        return Load(running, waiting, self.limit, until, None if running else self._last_end_ns)

    def predict_ttft_ns(self, elapsed_ns: int | None = None) -> int | None:
        """The TTFT of an event arriving now, behind the requests queued and on their way, and
        ``elapsed_ns`` since its ingest (None: one not yet through the steps before this one,
        which recently took their p99); None while nothing measured counts."""
        now = self._clock()
        return self.predictor.predict_ns(self._load(now, on_the_way=True), elapsed_ns, now)

    def refusal(self, rows: int, *, first_id: int | None = None) -> tuple[float, str] | None:
        """(retry after seconds, why) when a request of ``rows`` events would miss the TTFT
        target; None admits it, and it counts as one request on its way (a served pipeline's
        admission, before its rows start through the pipeline; a request counts as one, whatever
        its rows) until ``release(first_id)``, until one of its events (ids ``first_id`` to
        ``first_id + rows``) comes, or for a second (twice what events take to reach the step,
        if longer)."""
        now = self._clock()
        load = self._load(now, on_the_way=True)
        over = self.predictor.over(load, None, now)
        if over is not None and self.predictor.may_probe(load, now):
            over = None
            self.stats.probes += 1
        if over is None:
            before = self.predictor.upstream.quantile(self.spec.slo.quantile, now) or 0
            with self._lock:
                if first_id is None:
                    self._unkeyed -= 1
                    key, lo, hi = self._unkeyed, -1, -1
                else:
                    key, lo, hi = first_id, first_id, first_id + rows
                self._reserved[key] = (lo, hi, now + max(_RESERVE_NS, 2 * before))
            return None
        self.stats.refused += rows
        retry = self.predictor.retry_after_ns(load, None, now)
        retry_s = 0.05 if retry is None else max(0.001, math.ceil(retry / 1e6) / 1e3)
        return retry_s, _over_target(*over)

    def release(self, first_id: int) -> None:
        """The request admitted with ``first_id`` is no longer on its way to this step (its
        events came to their end elsewhere, or it was not taken after all)."""
        with self._lock:
            self._reserved.pop(first_id, None)

    def _came(self, ids: np.ndarray[Any, Any]) -> None:
        """Events ``ids`` came: the admissions they belong to no longer count as on their way."""
        ordered = np.sort(ids)
        with self._lock:
            for key, (lo, hi, _) in list(self._reserved.items()):
                if lo >= 0:
                    i = int(np.searchsorted(ordered, lo))
                    if i < ordered.size and ordered[i] < hi:
                        del self._reserved[key]
            unkeyed = sorted((k for k, (lo, _, _) in self._reserved.items() if lo < 0), reverse=True)
            for key in unkeyed[: ids.size]:  # admitted without ids: the oldest ones first
                del self._reserved[key]

    # -- the loop's side --------------------------------------------------------------------------
    def _arrive(self, batch: Batch) -> None:
        n = batch.num_rows
        now = self._clock()
        with self._lock:
            self._feeding -= n
        ids = batch.ids
        self._came(ids)
        prompts = batch.pylist(self.spec.prompt)
        tiers = batch.meta(TIER).tolist()
        born, id_list = batch.numpy(INGEST_NS).tolist(), ids.tolist()
        self.stats.requests += n
        for i, (prompt, tier) in enumerate(zip(prompts, tiers, strict=True)):
            self._seq += 1
            text = "" if prompt is None else str(prompt)
            req = _Request(batch.slice(i, 1), text, tier, now, born[i], id_list[i], self._seq)
            self.predictor.upstream.add(now, max(0, now - born[i]))
            self._admit(req)
        self._pump()

    def _admit(self, req: _Request) -> None:
        now = self._clock()
        load = self._load(now, on_the_way=False)
        over = self.predictor.over(load, now - req.born_ns, now)
        if over is not None and self.predictor.may_probe(load, now):
            over = None
            self.stats.probes += 1
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
        self._arm(req.born_ns)

    def _arm(self, born_ns: int) -> None:
        """Sweep the queue when a row born at ``born_ns`` reaches the TTFT target (if sooner
        than the sweep set already)."""
        target = self.spec.slo.ttft_ms
        if target is None:
            return
        due = born_ns + int(target * _MS) + 1
        if self._sweep is not None and self._sweep_at <= due:
            return
        if self._sweep is not None:
            self._sweep.cancel()
        delay_s = max(0.0, (due - self._clock()) / 1e9)
        self._sweep_at = due
        self._sweep = asyncio.get_running_loop().call_later(delay_s, self.sweep)

    def sweep(self) -> None:
        """Shed the queued rows whose wait reached the TTFT target (on the step's loop; a timer
        calls it at the earliest such time)."""
        self._sweep = None
        target = self.spec.slo.ttft_ms
        if target is None or not self._queued:
            return
        now, limit_ns = self._clock(), int(target * _MS)
        earliest = None
        for queue in self._queues.values():
            for req in [r for r in queue if now - r.born_ns > limit_ns]:
                queue.remove(req)
                self._queued -= 1
                self._shed_waited(req, now)
            born = min((r.born_ns for r in queue), default=None)
            if born is not None and (earliest is None or born < earliest):
                earliest = born
        if earliest is not None:
            self._arm(earliest)
        self._check_idle()

    def _shed_waited(self, req: _Request, now: int) -> None:
        waited, target = (now - req.born_ns) / _MS, self.spec.slo.ttft_ms or 0.0
        self._shed(req, f"waited {waited:.0f} ms, past the TTFT target {target:.0f} ms", "waited")

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
                self._shed_waited(req, now)
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
            self._last_end_ns = self._clock()
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
        self.predictor.record(self._clock(), gen.first_ns - gen.sent_ns, gen.done_ns - gen.sent_ns)
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
