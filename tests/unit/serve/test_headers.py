"""Request options from HTTP headers or gRPC metadata: a deadline in milliseconds, parsed
strictly, any text refused with the place it came from."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from aisp.errors import BadRequest
from aisp.serve.headers import MAX_DEADLINE_MS, Headers, parse_deadline_ms


@given(st.text(max_size=30))
def test_any_text_is_a_deadline_in_range_or_a_bad_request_naming_its_source(value: str) -> None:
    try:
        ms = parse_deadline_ms(value, "x-deadline")
    except BadRequest as exc:
        assert "x-deadline" in str(exc)
        return
    assert ms is not None and math.isfinite(ms) and 0 < ms <= MAX_DEADLINE_MS


@pytest.mark.parametrize("value", ["0", "-5", "nan", "inf", str(MAX_DEADLINE_MS * 2), "1e400", "ten"])
def test_impossible_deadlines_are_refused(value: str) -> None:
    with pytest.raises(BadRequest):
        parse_deadline_ms(value)


def test_headers_are_found_in_any_case() -> None:
    scope = {"headers": [(b"X-Request-Deadline-Ms", b"250"), (b"content-type", b"application/json")]}
    headers = Headers.of(scope)
    assert headers.get("x-request-deadline-ms") == "250" and headers.get("Content-Type") == "application/json"
    assert headers.get("missing", "-") == "-"
