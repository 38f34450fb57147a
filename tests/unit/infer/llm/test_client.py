"""The OpenAI-compatible client's request bodies and stream parsing (no server: the parts that are
pure functions of their inputs). The LLM step's admission: ``test_llm_admission``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from aisp.errors import ConfigError
from aisp.infer.llm.client import LlmError, OpenAIClient, _Stream

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


def test_the_api_key_comes_from_one_place_and_is_never_shown(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AISP_T_LLM_KEY", "sk-from-env")
    key_file = tmp_path / "key"
    key_file.write_text("sk-from-file\n")
    assert OpenAIClient("http://h", api_key_env="AISP_T_LLM_KEY")._headers == {
        "authorization": "Bearer sk-from-env"
    }
    assert OpenAIClient("http://h", api_key_file=str(key_file))._headers == {
        "authorization": "Bearer sk-from-file"
    }
    with pytest.raises(ConfigError, match="comes from api_key and api_key_env: give one") as info:
        OpenAIClient("http://h", api_key="sk-inline", api_key_env="AISP_T_LLM_KEY")
    assert "sk-inline" not in str(info.value) and "sk-from-env" not in str(info.value)
    with pytest.raises(ConfigError, match="AISP_T_UNSET_KEY: the variable is not set"):
        OpenAIClient("http://h", api_key_env="AISP_T_UNSET_KEY")
    client = OpenAIClient("http://h", api_key_file=str(key_file))
    assert "sk-from-file" not in repr(client.endpoints()) and "sk-from-file" not in repr(
        vars(client).get("_pool")
    )
