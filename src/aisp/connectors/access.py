"""How a connector reaches a secured broker: credentials and TLS, from a URL.

    SCHEME://USER:PASSWORD@HOST:PORT/NAME?tls=1&ca=PATH[&cert=PATH&key=PATH]

The password may come from the URL, from ``password_env=NAME`` (an environment variable: what a
Kubernetes secret gives) or from ``password_file=PATH`` (what a vault agent writes; one trailing
newline is dropped), one of them at most. ``Access`` holds the result; its ``repr`` and
everything this module raises leave the secret out (``aisp.secrets.mask``).
"""

from __future__ import annotations

import ssl
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, TypeVar
from urllib.parse import parse_qsl, urlencode, urlparse

from msgspec import UNSET, UnsetType

from aisp.connectors.url import Address, UrlOptions, mask, options
from aisp.errors import ConfigError
from aisp.secrets import read_secret

__all__ = ["Access", "SecuredOptions", "access_of", "access_options"]


class SecuredOptions(UrlOptions):
    """The options of a URL to a broker that may ask for credentials and TLS."""

    password_env: str | UnsetType = UNSET
    """The environment variable that holds the password."""
    password_file: str | UnsetType = UNSET
    """The file that holds the password."""
    tls: bool | UnsetType = UNSET
    """Connect with TLS (the server's certificate verified against ``ca``, else the system's)."""
    ca: str | UnsetType = UNSET
    """The CA certificate file (PEM) the server's certificate must chain to."""
    cert: str | UnsetType = UNSET
    """This client's certificate (PEM), for mutual TLS; with ``key``."""
    key: str | UnsetType = UNSET
    """This client's private key (PEM), for mutual TLS; with ``cert``."""

    ACCESS: ClassVar[tuple[str, ...]] = ()
    """A broker's own options about access (``creds``, ``sasl``), in its subclass."""

    def plain(self) -> dict[str, Any]:
        """The options the URL gave, less those about access: what a source or sink takes as
        it is (access goes to it as an ``Access``)."""
        access = {*SecuredOptions.__struct_fields__, *self.ACCESS}
        return {k: v for k, v in self.given().items() if k not in access}


@dataclass(frozen=True)
class Access:
    """Credentials and TLS settings for one broker connection (none: a plain connection)."""

    user: str | None = None
    password: str | None = field(default=None, repr=False)
    tls: bool = False
    ca: str | None = None
    cert: str | None = None
    key: str | None = None
    creds: str | None = None
    """A NATS credentials file (JWT and NKey seed)."""

    def ssl_context(self) -> ssl.SSLContext | None:
        """The client's TLS context (the server verified against ``ca``, else the system's CAs;
        ``cert`` and ``key`` presented for mutual TLS); None without TLS."""
        if not self.tls:
            return None
        context = ssl.create_default_context(cafile=self.ca)
        if self.cert is not None:
            context.load_cert_chain(self.cert, self.key)
        return context


def access_of(url: str, address: Address, opts: SecuredOptions, *, tls: bool = False) -> Access:
    """The ``Access`` that ``url`` (parsed as ``address`` and ``opts``) asks for; ``tls``: the
    scheme implies it (``rediss://``). A password given twice, a variable not set, a file not
    readable, a certificate without its key or a TLS file that does not exist is an error naming
    the option, never the secret."""
    password = read_secret(
        repr(mask(url)),
        address.password,
        env=opts.password_env if isinstance(opts.password_env, str) else None,
        file=opts.password_file if isinstance(opts.password_file, str) else None,
        names=("the URL", "password_env", "password_file"),
    )
    ca, cert, key = (v if isinstance(v, str) else None for v in (opts.ca, opts.cert, opts.key))
    if (cert is None) != (key is None):
        raise ConfigError(f"{mask(url)!r}: a client certificate needs both cert= and key=")
    for name, path in (("ca", ca), ("cert", cert), ("key", key)):
        if path is not None and not Path(path).is_file():
            raise ConfigError(f"{mask(url)!r}: {name}={path}: no such file")
    if opts.tls is False and (ca is not None or cert is not None):
        raise ConfigError(f"{mask(url)!r}: ca=, cert= and key= are TLS settings, but tls=0")
    wants_tls = tls or opts.tls is True or any(v is not None for v in (ca, cert))
    return Access(address.user, password, wants_tls, ca, cert, key)


S = TypeVar("S", bound=SecuredOptions)


def access_options(url: str, kind: type[S]) -> S:
    """The options of ``url`` about access only, as ``kind`` (the others, whatever they are, left
    out): for the tools that reach a broker by any of its URLs, an input's or an output's."""
    parsed = urlparse(url)
    wanted = {*SecuredOptions.__struct_fields__, *kind.ACCESS}
    kept = [(k, v) for k, v in parse_qsl(parsed.query) if k in wanted]
    return options(parsed._replace(query=urlencode(kept)).geturl(), kind)
