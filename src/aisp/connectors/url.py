"""What every connector parses out of its URLs: ``SCHEME://[USER[:PASSWORD]@]HOST:PORT/NAME?OPTION=VALUE&...``.

A URL may hold a secret (a password, a token), so what this module says about one, in an error
or anywhere else, is ``mask(url)``: the secret replaced by ``***``."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any, TypeVar, get_args
from urllib.parse import parse_qs, unquote, urlparse

import msgspec

from aisp.errors import ConfigError
from aisp.secrets import mask

__all__ = ["Address", "UrlOptions", "file_path", "mask", "options", "scheme_of"]


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
    """``SCHEME://[USER[:PASSWORD]@]HOST:PORT/NAME``: the broker (host and port, defaults filled
    in), the name of the stream or topic, and the credentials the URL holds (percent-decoded;
    ``user`` alone is a token to NATS)."""

    host: str
    port: int
    name: str
    user: str | None = None
    password: str | None = field(default=None, repr=False)

    @classmethod
    def parse(cls, url: str, default_port: int, what: str) -> Address:
        """``what``: the kind of name the path holds (``stream``, ``topic``), for the error."""
        parsed = urlparse(url)
        name = parsed.path.lstrip("/")
        if not name:
            raise ConfigError(
                f"{mask(url)!r}: name the {what}, as {parsed.scheme}://HOST:PORT/{what.upper()}"
            )
        try:
            port = parsed.port or default_port
        except ValueError as exc:
            raise ConfigError(f"{mask(url)!r}: {exc}") from None
        user = unquote(parsed.username) if parsed.username is not None else None
        password = unquote(parsed.password) if parsed.password is not None else None
        return cls(parsed.hostname or "127.0.0.1", port, name, user or None, password)

    @property
    def hostport(self) -> str:
        return f"{self.host}:{self.port}"


class UrlOptions(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """The query options one kind of URL takes (a connector's input, output, load target): a
    subclass names each option and its type, in one place. An option left out of the URL is
    ``UNSET``, and ``given()`` leaves it out, so the default is the one of the source or sink
    it configures (``RedisStreamSource.group``, ...), not a second copy here."""

    def given(self) -> dict[str, Any]:
        """The options the URL gave, by name."""
        return {k: v for k, v in msgspec.structs.asdict(self).items() if v is not msgspec.UNSET}


OptionsT = TypeVar("OptionsT", bound=UrlOptions)

_FLAGS = {"yes": "true", "no": "false"}


def options(url: str, kind: type[OptionsT]) -> OptionsT:
    """The query options of ``url`` as ``kind`` (``msgspec.convert`` from text: a ``bool`` is
    true/false, 1/0 or yes/no; a ``float`` is finite: no option is a duration or a size of nan
    or inf); an unknown one is an error naming the known ones.

    >>> class Opts(UrlOptions):
    ...     group: str | msgspec.UnsetType = msgspec.UNSET
    ...     retry_s: float | msgspec.UnsetType = msgspec.UNSET
    ...     x: bool | msgspec.UnsetType = msgspec.UNSET
    >>> options("redis://h/s?group=g&retry_s=2&x=yes", Opts).given()
    {'group': 'g', 'retry_s': 2.0, 'x': True}
    """
    fields = {f.name: _kind(f.type) for f in msgspec.structs.fields(kind)}
    query = {key: values[-1] for key, values in parse_qs(urlparse(url).query, strict_parsing=False).items()}
    for key, text in query.items():
        if key not in fields:
            raise ConfigError(f"{mask(url)!r}: unknown option {key!r}; options are {sorted(fields)}")
        if fields[key] is bool:
            query[key] = _FLAGS.get(text.strip().lower(), text.strip())
    try:
        value = msgspec.convert(query, kind, strict=False)
    except msgspec.ValidationError as exc:
        path = re.search(r"at `\$\.(\w+)`", str(exc))
        key = path.group(1) if path else ""
        raise ConfigError(_not_a(url, key, query.get(key, ""), fields.get(key))) from None
    for key in query:
        got = getattr(value, key)
        if isinstance(got, float) and not math.isfinite(got):
            raise ConfigError(_not_a(url, key, query[key], float))
    return value


def _kind(annotation: Any) -> type:
    """The type of an option, ``UNSET`` and None aside (``float | UnsetType`` -> float)."""
    kinds = [t for t in get_args(annotation) if t not in (msgspec.UnsetType, type(None))]
    return kinds[0] if kinds else annotation  # type: ignore[no-any-return]


def _not_a(url: str, key: str, text: str, kind: type | None) -> str:
    return f"{mask(url)!r}: option {key}={text!r} is not a {getattr(kind, '__name__', kind)}"
