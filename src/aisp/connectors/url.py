"""What every connector parses out of its URLs: ``SCHEME://HOST:PORT/NAME?OPTION=VALUE&...``."""

from __future__ import annotations

import math
from dataclasses import dataclass
from urllib.parse import parse_qs, urlparse

from aisp.errors import ConfigError

__all__ = ["Address", "file_path", "options", "scheme_of"]


def scheme_of(url: str) -> str:
    """The scheme a URL is resolved by: ``file`` for a plain path (or a Windows drive letter)."""
    scheme = urlparse(url).scheme
    return "file" if len(scheme) <= 1 else scheme


def file_path(url: str) -> str:
    """The path of ``file://PATH`` or of a plain path."""
    parsed = urlparse(url)
    return parsed.path if parsed.scheme == "file" else url


@dataclass(frozen=True)
class Address:
    """``SCHEME://HOST:PORT/NAME``: the broker (host and port, defaults filled in) and the name of
    the stream or topic."""

    host: str
    port: int
    name: str

    @classmethod
    def parse(cls, url: str, default_port: int, what: str) -> Address:
        """``what``: the kind of name the path holds (``stream``, ``topic``), for the error."""
        parsed = urlparse(url)
        name = parsed.path.lstrip("/")
        if not name:
            raise ConfigError(f"{url!r}: name the {what}, as {parsed.scheme}://HOST:PORT/{what.upper()}")
        try:
            port = parsed.port or default_port
        except ValueError as exc:
            raise ConfigError(f"{url!r}: {exc}") from None
        return cls(parsed.hostname or "127.0.0.1", port, name)

    @property
    def hostport(self) -> str:
        return f"{self.host}:{self.port}"


def options(url: str, allowed: dict[str, type]) -> dict[str, object]:
    """The query options of ``url``, typed (a ``bool`` is true/false, 1/0 or yes/no; a ``float`` is
    finite: no option is a duration or a size of nan or inf); an unknown one is an error naming
    the known ones.

    >>> options("redis://h/s?group=g&retry_s=2&x=yes", {"group": str, "retry_s": float, "x": bool})
    {'group': 'g', 'retry_s': 2.0, 'x': True}
    """
    out: dict[str, object] = {}
    for key, values in parse_qs(urlparse(url).query, strict_parsing=False).items():
        if key not in allowed:
            raise ConfigError(f"{url!r}: unknown option {key!r}; options are {sorted(allowed)}")
        try:
            out[key] = _typed(values[-1], allowed[key])
        except ValueError:
            raise ConfigError(
                f"{url!r}: option {key}={values[-1]!r} is not a {allowed[key].__name__}"
            ) from None
    return out


def _typed(text: str, kind: type) -> object:
    if kind is bool:
        return _flag(text)
    value = kind(text)
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(text)
    return value


def _flag(text: str) -> bool:
    value = text.strip().lower()
    if value not in ("true", "1", "yes", "false", "0", "no"):
        raise ValueError(text)
    return value in ("true", "1", "yes")
