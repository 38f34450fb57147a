"""The OpenAI-compatible client's request bodies and stream parsing, and the LLM step's TTFT
prediction and admission (no server: the parts that are pure functions of their inputs)."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from aisp.batch import Batch
from aisp.errors import ConfigError
from aisp.infer.llm import LlmError, OpenAIClient, _Stream
from aisp.infer.llm_stage import LlmSlo, LlmSpec, LlmStage

MS = 1_000_000


def chunk(
    content: str | None = None, *, finish: str | None = None, usage: dict[str, int] | None = None
) -> str:
    delta = {} if content is None else {"content": content}
    msg: dict[str, object] = {"choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}
    if usage is not None:
        msg["usage"] = usage
    return b"data: " + json.dumps(msg).encode()


def test_bodies_for_chat_and_completions() -> None:
    chat = OpenAIClient("http://h:1/", model="m", system="be brief", max_tokens=7, params={"seed": 3})
    body = chat.body("hi")
    assert body["stream"] is True and body["max_tokens"] == 7 and body["seed"] == 3 and body["model"] == "m"
    assert body["messages"] == [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    plain = OpenAIClient(["http://a:1", "http://b:2"], api="completions").body("once upon", max_tokens=3)
    assert plain["prompt"] == "once upon" and plain["max_tokens"] == 3 and "model" not in plain
    with pytest.raises(ConfigError):
        OpenAIClient([])
    with pytest.raises(ConfigError):
        OpenAIClient("http://h:1", api="embeddings")
    with pytest.raises(ConfigError):
        OpenAIClient("http://h:1", concurrency=0)


def test_a_chat_stream_is_read_piece_by_piece_until_done() -> None:
    state, pieces = _Stream(0, "http://h:1"), []
    lines = [b": keep-alive", b"", chunk(), chunk("Par"), chunk("is"), chunk(finish="stop"),
             chunk(usage={"completion_tokens": 2, "prompt_tokens": 9}), b"data: [DONE]"]  # fmt: skip
    firsts = [state.take(line, "chat", pieces.append) for line in lines]
    assert firsts == [False, False, False, True, False, False, False, False]
    assert pieces == ["Par", "is"] and state.ended
    gen = state.finished()
    assert (gen.text, gen.pieces, gen.completion_tokens, gen.prompt_tokens, gen.finish_reason) == (
        "Paris", 2, 2, 9, "stop",
    )  # fmt: skip


def test_a_completions_stream_and_an_error_in_the_stream() -> None:
    state, pieces = _Stream(0, "x"), []
    state.take(b'data: {"choices": [{"text": "Hello"}]}', "completions", pieces.append)
    assert pieces == ["Hello"]
    with pytest.raises(LlmError, match="server error") as info:
        state.take(b'data: {"error": {"message": "boom"}}', "completions", pieces.append)
    assert info.value.tokens == 1


@given(st.text(max_size=200), st.sampled_from(["chat", "completions"]))
def test_any_line_is_taken_or_refused_with_a_clear_error(line: str, api: str) -> None:
    state = _Stream(0, "x")
    for text in (line, "data:" + line, "data: " + json.dumps({"choices": [{"delta": line, "text": line}]})):
        try:
            state.take(text.encode(), api, lambda _: None)
        except (LlmError, ValueError):  # ValueError: not JSON (the client fails the attempt with it)
            pass


JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=5),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=12,
)


@given(JSON)
def test_any_json_value_in_the_stream_is_taken_or_refused(value: object) -> None:
    state = _Stream(0, "x")
    try:
        state.take(b"data: " + json.dumps(value).encode(), "chat", lambda _: None)
    except LlmError:
        pass


def stage(slo: LlmSlo, now: list[int]) -> LlmStage:
    spec = LlmSpec(client=OpenAIClient("http://127.0.0.1:9"), slo=slo)
    return LlmStage(spec, emit=lambda b: None, emit_made=lambda b: None, dead_letter=lambda b, r: None,
                    clock=lambda: now[0])  # fmt: skip


def test_ttft_prediction_from_running_requests_and_recent_times() -> None:
    now = [10_000 * MS]
    s = stage(LlmSlo(ttft_ms=1000.0), now)
    assert s.predict_ttft_ns(0) is None  # nothing measured yet
    s.stats.recent_generation_ns.extend([400 * MS] * 8)
    s.stats.recent_first_ns.extend([50 * MS] * 8)
    assert s.predict_ttft_ns(0) == 50 * MS  # a free slot: the server's first token
    s._running[1] = now[0] - 100 * MS  # one slot, busy for 100 ms of its 400
    assert s.predict_ttft_ns(0) == 300 * MS + 50 * MS
    assert s.predict_ttft_ns(2) == 300 * MS + 2 * 400 * MS + 50 * MS


def test_refusal_when_the_predicted_ttft_is_over_the_target_and_admitted_requests_count() -> None:
    now = [10_000 * MS]
    s = stage(LlmSlo(ttft_ms=1000.0, margin=0.9), now)
    s.stats.recent_generation_ns.extend([400 * MS] * 8)
    s.stats.recent_first_ns.extend([50 * MS] * 8)
    s._running[1] = now[0]
    assert s.refusal(1) is None  # waits 400 + 50 ms
    assert s.refusal(1) is None  # behind one on its way: 850 ms
    refused = s.refusal(1)  # 1250 ms > 900 ms
    assert refused is not None and refused[0] > 0 and "over the target" in refused[1]
    assert s.stats.refused == 1
    now[0] += 1_100 * MS  # the admitted ones did not come within a second: no longer counted
    s._running[1] = now[0]
    assert s.refusal(1) is None


def test_jitter_and_rate_of_recent_requests() -> None:
    s = stage(LlmSlo(), [0])
    assert s.stats.jitter == 0.0 and s.stats.tokens_per_s == 0.0
    s.stats.recent_jitter.extend([0.1, 0.3])
    assert s.stats.jitter == pytest.approx(0.2)


def test_an_empty_batch_starts_nothing() -> None:
    s = stage(LlmSlo(), [0])
    s.feed(Batch.from_columns({"prompt": np.array([], dtype=object)}))
    assert s._loop is None
    s.close()
