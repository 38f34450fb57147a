"""A served pipeline's admission by its LLM step's time-to-first-token target: a request let in
counts as on its way to the step only until its events come there or come to their end
elsewhere, so requests whose rows never reach the LLM (a passage upload) hold no place for it."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import msgspec
import numpy as np
import pytest

from aisp import CollectSink, Pipeline, WorkloadFSource
from aisp.batch import Batch
from aisp.errors import Overloaded
from aisp.infer.llm.admission import LlmSlo
from aisp.infer.llm.stage import LlmSpec
from aisp.serve.admission import PipelineAdmission
from aisp.serve.pipelines.service import PipelineService
from tests.unit.infer.llm.test_admission import FakeLlm


class Row(msgspec.Struct):
    op: str
    n: int


class Now:
    """The real clock, for a fake LLM that answers at once."""

    def __call__(self) -> int:
        return time.monotonic_ns()

    def advance_s(self, seconds: float) -> None:
        pass


def qa_pipeline() -> Pipeline:
    p = Pipeline("qa", output_columns=["n", "answer"])
    rows = p.source("rows", WorkloadFSource(events=1), schema=Row)
    questions = rows.filter("questions", lambda b: np.asarray(b.pylist("op")) == "query")
    prompts = questions.map_batch("prompt", lambda b: b.with_columns({"prompt": ["q"] * b.num_rows}))
    llm = FakeLlm(Now(), lambda n: 0)  # type: ignore[arg-type]
    spec = LlmSpec(client=llm, slo=LlmSlo(ttft_ms=1000.0), tokens=False)
    prompts.llm("llm", spec).sink("out", CollectSink(columns=["n", "answer"]))
    return p


@pytest.fixture
def service() -> Iterator[PipelineService]:
    s = PipelineService(qa_pipeline(), chunk_rows=64)
    s.start()
    yield s
    assert s.close()


def ask(service: PipelineService, rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    prepared, chunk, _ = service.prepare([json.dumps(r).encode() for r in rows])
    admitted = PipelineAdmission(service, limiter=None, wait_s=10.0).admit(
        prepared, chunk, key="", tier=None, first=True
    )
    assert admitted and chunk is not None and chunk.done.wait(10)
    return [json.loads(x) for x in chunk.lines(0, chunk.n).splitlines()]


def test_uploads_that_never_reach_the_llm_hold_no_place_for_it(service: PipelineService) -> None:
    stage = service.executor.llm_stages["llm"]
    for i in range(3):  # passage uploads: filtered out before the LLM step
        assert ask(service, [{"op": "upsert", "n": i}, {"op": "upsert", "n": i + 10}]) == [
            {"dropped": "questions"}, {"dropped": "questions"},
        ]  # fmt: skip
    assert not stage._reserved  # done elsewhere: no longer on their way to the step
    out = ask(service, [{"op": "query", "n": 7}])  # right after the uploads: admitted, answered
    assert out == [{"n": 7, "answer": "ab"}] and stage.stats.refused == 0
    assert not stage._reserved


def test_a_request_turned_away_after_the_llm_let_it_in_stops_counting(service: PipelineService) -> None:
    stage = service.executor.llm_stages["llm"]
    prepared, chunk, _ = service.prepare([b'{"op": "query", "n": 1}'])
    assert isinstance(prepared, Batch)
    admission = PipelineAdmission(service, limiter=None, wait_s=0.0)
    service.offer = lambda batch, chunk: False  # type: ignore[method-assign]  # the inbox stays full
    with pytest.raises(Overloaded, match="admission queue is full"):
        admission.admit(prepared, chunk, key="", tier=None, first=True)
    assert not stage._reserved
