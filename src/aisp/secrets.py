"""What AISP never prints: the secret a URL may hold (a password, a token), replaced by ``***``
wherever a URL goes into an error, a log line, a summary or a status page."""

from __future__ import annotations

import re

__all__ = ["mask"]

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
