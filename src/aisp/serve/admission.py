"""Admission, one component for every transport (HTTP, gRPC and any later one).

``admit_infer``: an inference request's timeout (the transport's deadline, or the OIP
``timeout`` parameter if sooner), the rate limits of its API key and tier (``Overloaded``, 429
/ RESOURCE_EXHAUSTED), and its check against the model's signature (``BadRequest``).
``PipelineAdmission``: a served pipeline's events: rate limits, its anomaly-controlled rate
(``aisp.admission.anomaly``), its LLM steps' time-to-first-token targets, then room in its inbox.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Coroutine, Iterator
from typing import Any

import msgspec
import numpy.typing as npt

from aisp.admission.ratelimit import Limiter
from aisp.batch import Batch
from aisp.errors import AispError, Overloaded
from aisp.infer.llm.stage import LlmStage
from aisp.retry import Backoff
from aisp.serve.models.served import InferResult
from aisp.serve.models.server import ModelServer
from aisp.serve.oip.request import InferRequest, Signature, check_request
from aisp.serve.pipelines.service import Chunk, PipelineService

__all__ = ["Admitted", "PipelineAdmission", "admit_infer", "collect_admitted", "infer_admitted"]


class Admitted(msgspec.Struct, frozen=True):
    """A request let in: its checked arrays and the options for ``ModelServer.infer``
    (``checked=True`` with them)."""

    arrays: dict[str, npt.NDArray[Any]]
    version: str | None
    priority: int
    tier: int | None
    timeout_s: float | None
    key: str | None = None


def infer_admitted(models: ModelServer, name: str, a: Admitted) -> Coroutine[Any, Any, InferResult]:
    """``models.infer_async`` on an admitted request (the coroutine itself: no frame of its own,
    no keyword dictionary per request)."""
    return models.infer_async(
        name,
        a.arrays,
        version=a.version,
        priority=a.priority,
        tier=a.tier,
        timeout_s=a.timeout_s,
        checked=True,
        key=a.key,
    )


def collect_admitted(
    models: ModelServer,
    into: dict[Any, list[Any]] | None,
    name: str,
    a: Admitted,
    on_done: Callable[[InferResult | AispError], None],
) -> None:
    """``models.collect`` on an admitted request: the form of ``infer_admitted`` answered
    through ``on_done`` (into ``into`` for one ``submit_collected``: the native gRPC front; with
    ``into`` None, into the event loop's gather: a gRPC stream)."""
    models.collect(
        into,
        name,
        a.arrays,
        on_done,
        version=a.version,
        priority=a.priority,
        tier=a.tier,
        timeout_s=a.timeout_s,
        checked=True,
        key=a.key,
    )


def admit_infer(
    models: ModelServer,
    limiter: Limiter | None,
    req: InferRequest,
    sig: Signature,
    *,
    version: str | None,
    tier: int | None,
    timeout_s: float | None,
    api_key: str,
) -> Admitted:
    """Admit ``req`` for model ``sig.model`` or raise why not (see the module docstring)."""
    if req.timeout_us is not None:
        timeout_s = min(timeout_s or float("inf"), req.timeout_us / 1e6)
    if limiter is not None:
        rows = int(req.inputs[0].shape[0]) if req.inputs and req.inputs[0].shape else 1
        level = tier if tier is not None else models.tier_of(sig.model, req.priority)
        wait = limiter.admit(api_key, level, rows)
        if wait:
            raise Overloaded(f"rate limit: retry in {wait:.3f} s", retry_after_s=wait)
    return Admitted(check_request(req, sig), version, req.priority, tier, timeout_s, req.rollout_key)


def _pauses() -> Iterator[float]:
    """Waits between offers to a full inbox: 0.2 ms, doubling up to 5 ms (one waiter: no jitter)."""
    return Backoff(0.0002, 0.005, jitter=False).delays()


def _release_when_done(chunk: Chunk, release: Callable[[], None]) -> None:
    """Call ``release`` (as well as the chunk's own ``notify``) once every event of ``chunk``
    is done."""
    notify = chunk.notify

    def done() -> None:
        if chunk.prefix == chunk.n:
            release()
        if notify is not None:
            notify()

    chunk.notify = done


class PipelineAdmission:
    """Admission of a served pipeline's events, the same for every transport.

    A request's events come in chunks. Each admitted chunk first passes the rate limits of its
    API key and tier, then needs room in the pipeline's inbox (its bounded admission queue).
    The first chunk of a request is refused (``Overloaded``: 429 with ``Retry-After`` /
    RESOURCE_EXHAUSTED) when a rate limit applies, or when the inbox stays full for ``wait_s``;
    later chunks of an accepted request wait instead, which is how a stream stops reading.
    ``admit_async`` serves event loops, ``admit`` threads (which ``stop`` can release).
    """

    def __init__(self, service: PipelineService, *, limiter: Limiter | None, wait_s: float) -> None:
        self.service, self.limiter, self.wait_s = service, limiter, wait_s

    def _rate_wait(self, rows: int, key: str, tier: int | None, first: bool) -> float:
        if self.limiter is None or not rows:
            return 0.0
        wait = self.limiter.admit(key, tier if tier is not None else 0, rows)
        if wait and first:
            self.service.refused(rows, rate_limited=True)
            raise Overloaded(f"rate limit: retry in {wait:.3f} s", retry_after_s=wait)
        return wait

    def _control_wait(self, rows: int, first: bool, again: bool) -> float:
        """The pipeline's anomaly-controlled rate: 0.0 once admitted; a first chunk over it is
        refused (``Retry-After`` from the control), a later one waits what this returns."""
        control = self.service.control
        if control is None or not rows:
            return 0.0
        if not again:
            control.offered(rows)
        wait = control.take(rows)
        if wait and first:
            self.service.refused(rows, rate_limited=True)
            retry = control.retry_after_s()
            raise Overloaded(
                f"pipeline {self.service.name!r} admits {control.rate:,.0f} events/s while its anomaly"
                f" condition holds; retry in {retry:.3f} s",
                retry_after_s=retry,
            )
        return wait

    def _llm_check(self, batch: Batch | None, chunk: Chunk | None, first: bool) -> Callable[[], None] | None:
        """A first chunk that an LLM step predicts would miss its time-to-first-token target
        is refused before it starts (``LlmStage.refusal``). One let in counts as on its way to
        each LLM step until its events come there or come to their end elsewhere (its chunk is
        done: it holds no place for the LLM); the function returned takes it off (the chunk was
        not taken after all)."""
        stages = self.service.executor.llm_stages
        if not first or batch is None or not batch.num_rows or not stages:
            return None
        rows, first_id = batch.num_rows, int(batch.ids[0])
        admitted: list[LlmStage] = []
        for step, stage in stages.items():
            refused = stage.refusal(rows, first_id=first_id)
            if refused is not None:
                for taken in admitted:
                    taken.release(first_id)
                self.service.refused(rows)
                retry, why = refused
                raise Overloaded(
                    f"pipeline {self.service.name!r}: LLM step {step!r}: {why}; retry in {retry:.2f} s",
                    retry_after_s=retry,
                )
            admitted.append(stage)

        def release() -> None:
            for stage in admitted:
                stage.release(first_id)

        if chunk is not None:
            _release_when_done(chunk, release)
        return release

    def _give_up(self, rows: int, first: bool, deadline: float, release: Callable[[], None] | None) -> None:
        if first and time.monotonic() >= deadline:
            if release is not None:
                release()
            self.service.refused(rows)
            raise Overloaded(
                f"pipeline {self.service.name!r} is overloaded: its admission queue is full; retry later"
            )

    async def admit_async(
        self, batch: Batch | None, chunk: Chunk | None, *, key: str, tier: int | None, first: bool
    ) -> None:
        rows = 0 if batch is None else batch.num_rows
        wait = self._rate_wait(rows, key, tier, first)
        if wait:
            await asyncio.sleep(wait)
        wait = self._control_wait(rows, first, again=False)
        while wait:  # a later chunk of a stream waits for the controlled rate
            await asyncio.sleep(wait)
            wait = self._control_wait(rows, first, again=True)
        release = self._llm_check(batch, chunk, first)
        deadline = time.monotonic() + self.wait_s
        for pause in _pauses():
            if self.service.offer(batch, chunk):
                return
            self._give_up(rows, first, deadline, release)
            await asyncio.sleep(pause)

    def admit(
        self,
        batch: Batch | None,
        chunk: Chunk | None,
        *,
        key: str,
        tier: int | None,
        first: bool,
        stop: threading.Event | None = None,
    ) -> bool:
        """``admit_async`` for a thread; False if ``stop`` was set before there was room."""
        stop = stop or threading.Event()
        rows = 0 if batch is None else batch.num_rows
        wait = self._rate_wait(rows, key, tier, first)
        if wait and stop.wait(wait):
            return False
        wait = self._control_wait(rows, first, again=False)
        while wait:
            if stop.wait(wait):
                return False
            wait = self._control_wait(rows, first, again=True)
        release = self._llm_check(batch, chunk, first)
        deadline = time.monotonic() + self.wait_s
        for pause in _pauses():
            if self.service.offer(batch, chunk):
                return True
            self._give_up(rows, first, deadline, release)
            if stop.wait(pause):
                if release is not None:
                    release()
                return False
        raise AssertionError("unreachable")  # _pauses never ends
