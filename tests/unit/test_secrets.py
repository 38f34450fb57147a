"""``aisp.secrets.mask``: whatever a URL's user information holds, the secret never survives."""

from __future__ import annotations

from urllib.parse import quote

from hypothesis import given
from hypothesis import strategies as st

from aisp.secrets import mask

NAMES = st.text(st.characters(min_codepoint=97, max_codepoint=122), min_size=1, max_size=6)


@given(st.sampled_from(["redis", "rediss", "nats", "kafka", "http"]), NAMES, st.text(min_size=1), NAMES)
def test_the_secret_of_any_url_is_masked_and_the_rest_kept(
    scheme: str, user: str, secret: str, host: str
) -> None:
    encoded = quote(f"pw!{secret}", safe="")
    assert mask(f"{scheme}://{user}:{encoded}@{host}:1/s?x=1") == f"{scheme}://{user}:***@{host}:1/s?x=1"
    assert mask(f"{scheme}://{encoded}@{host}/s") == f"{scheme}://***@{host}/s"  # a token alone
    assert mask(f"{scheme}://{host}:1/s?a=b@c") == f"{scheme}://{host}:1/s?a=b@c"  # an @ past the host
