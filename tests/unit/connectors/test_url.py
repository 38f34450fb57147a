"""What connectors parse out of their URLs: typed query options from any text, addresses with
their defaults, and errors that name the option or the URL."""

from __future__ import annotations

import math
from urllib.parse import quote

import pytest
from hypothesis import given
from hypothesis import strategies as st
from msgspec import UNSET, UnsetType

from aisp.connectors.url import Address, UrlOptions, file_path, options, scheme_of
from aisp.errors import ConfigError

ALLOWED: dict[str, type] = {"group": str, "partitions": int, "retry_s": float, "compact": bool}


class Opts(UrlOptions):
    group: str | UnsetType = UNSET
    partitions: int | UnsetType = UNSET
    retry_s: float | UnsetType = UNSET
    compact: bool | UnsetType = UNSET


@given(st.sampled_from(sorted(ALLOWED)), st.text(max_size=12))
def test_any_option_value_is_typed_or_refused_naming_the_option(name: str, value: str) -> None:
    url = f"kafka://h:1/t?{name}={quote(value, safe='')}"
    try:
        got = options(url, Opts).given()
    except ConfigError as exc:
        assert f"option {name}=" in str(exc) and ALLOWED[name] is not str
        return
    if name in got:  # an empty value leaves the option out (parse_qs drops it)
        typed = got[name]
        assert isinstance(typed, ALLOWED[name])
        if isinstance(typed, float):
            assert math.isfinite(typed)  # nan and inf are no durations


@given(st.text(st.characters(min_codepoint=97, max_codepoint=122), min_size=1, max_size=8))
def test_an_unknown_option_is_refused_naming_the_known_ones(name: str) -> None:
    if name in ALLOWED:
        return
    with pytest.raises(ConfigError, match="unknown option") as info:
        options(f"redis://h/s?{name}=1", Opts)
    assert str(sorted(ALLOWED)) in str(info.value)


@pytest.mark.parametrize("value", ["nan", "inf", "-inf", "NaN", "1e999"])
def test_non_finite_numbers_are_refused(value: str) -> None:
    with pytest.raises(ConfigError, match="retry_s"):
        options(f"nats://h/s?retry_s={value}", Opts)


def test_addresses_take_defaults_and_name_what_is_missing() -> None:
    assert Address.parse("kafka:///topic", 9092, "topic") == Address("127.0.0.1", 9092, "topic")
    assert Address.parse("redis://10.0.0.2:7000/s?x=1", 6379, "stream").hostport == "10.0.0.2:7000"
    with pytest.raises(ConfigError, match="name the topic"):
        Address.parse("kafka://h:1/", 9092, "topic")
    with pytest.raises(ConfigError, match="99999"):
        Address.parse("kafka://h:99999/t", 9092, "topic")


def test_plain_paths_are_files() -> None:
    assert scheme_of("/data/in.jsonl") == scheme_of("C:\\data\\in.jsonl") == "file"
    assert scheme_of("nats://h/s") == "nats"
    assert file_path("file:///data/in.jsonl") == file_path("/data/in.jsonl") == "/data/in.jsonl"
