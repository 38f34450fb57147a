"""What AISP never prints: the secret a URL may hold (a password, a token), replaced by ``***``
wherever a URL goes into an error, a log line, a summary or a status page."""

from __future__ import annotations

import os
import re
from pathlib import Path

from aisp.errors import ConfigError

__all__ = ["mask", "read_secret"]

_USERINFO = re.compile(r"^(?P<scheme>[A-Za-z][A-Za-z0-9+.-]*://)(?P<info>[^@/?#]*)@")


def mask(url: str) -> str:
    """``url`` with its secret replaced by ``***``: the password of ``USER:PASSWORD@``, or the
    whole of a ``TOKEN@`` (a user name alone is a token to NATS).

    >>> mask("redis://app:s3cret@h:6379/s"), mask("nats://tok@h/S"), mask("kafka://h:9092/t")
    ('redis://app:***@h:6379/s', 'nats://***@h/S', 'kafka://h:9092/t')
    """
    m = _USERINFO.match(url)
    if m is None:
        return url
    user, colon, _ = m.group("info").partition(":")
    info = f"{user}:***" if colon else "***"
    return f"{m.group('scheme')}{info}@{url[m.end() :]}"


def read_secret(
    what: str,
    value: str | None = None,
    *,
    env: str | None = None,
    file: str | None = None,
    names: tuple[str, str, str] = ("api_key", "api_key_env", "api_key_file"),
) -> str | None:
    """A secret (an API key, a token) given as ``value``, in the environment variable ``env``
    (what a Kubernetes secret gives) or in ``file`` (what a vault agent writes; one trailing
    newline dropped), one of them at most; None when none is given. ``names`` are the three
    options as the user wrote them: errors name the option and ``what`` needs it, never the secret.

    >>> import os; os.environ["AISP_DOCTEST_KEY"] = "k-1"
    >>> read_secret("a model pool", env="AISP_DOCTEST_KEY"), read_secret("a model pool")
    ('k-1', None)
    >>> read_secret("an LLM client", "k-2", env="AISP_DOCTEST_KEY")
    Traceback (most recent call last):
    aisp.errors.ConfigError: an LLM client: the secret comes from api_key and api_key_env: give one
    """
    given = [name for name, v in zip(names, (value is not None, env, file), strict=True) if v]
    if len(given) > 1:
        raise ConfigError(f"{what}: the secret comes from {' and '.join(given)}: give one")
    if env:
        if env not in os.environ:
            raise ConfigError(f"{what}: {names[1]}={env}: the variable is not set")
        return os.environ[env]
    if file:
        try:
            return Path(file).read_text().removesuffix("\n")
        except OSError as exc:
            raise ConfigError(f"{what}: {names[2]}={file}: {exc.strerror or exc}") from None
    return value
