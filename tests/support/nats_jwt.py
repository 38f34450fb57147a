"""A NATS operator, an account and its users made here, for tests of ``creds=`` (decentralised
JWT authentication): what ``nsc`` would make, written with the ``nkeys`` package.

A JWT is ``base64url(header) . base64url(claims) . base64url(ed25519 signature)`` with the header
``{"typ":"JWT","alg":"ed25519-nkey"}``; the claims name the issuer's and the subject's public
NKeys and carry a ``nats`` object of the claim's type (version 2). The operator signs itself and
the account; the account signs its users. The server trusts the operator (``operator:``) and
knows the account from ``resolver_preload``; a client proves itself with a credentials file (the
user's JWT and NKey seed).
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import nkeys

_UNLIMITED = {
    "subs": -1, "data": -1, "payload": -1, "imports": -1, "exports": -1, "wildcards": True,
    "conn": -1, "leaf": -1, "mem_storage": -1, "disk_storage": -1, "streams": -1, "consumer": -1,
}  # fmt: skip  # JetStream is on for an account whose storage limits are not 0


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).decode().rstrip("=")


@dataclass(frozen=True)
class Key:
    seed: bytes
    public: str

    @classmethod
    def new(cls, prefix: int) -> Key:
        seed = nkeys.encode_seed(os.urandom(32), prefix)
        return cls(seed, nkeys.from_seed(bytearray(seed)).public_key.decode())

    def sign(self, data: bytes) -> bytes:
        return bytes(nkeys.from_seed(bytearray(self.seed)).sign(data))


def jwt(issuer: Key, subject: str, name: str, nats: dict[str, Any]) -> str:
    claims: dict[str, Any] = {"iat": int(time.time()), "iss": issuer.public, "name": name, "sub": subject,
                              "nats": {**nats, "version": 2}}  # fmt: skip
    digest = hashlib.new("sha512_256", json.dumps(claims, separators=(",", ":")).encode()).digest()
    claims["jti"] = base64.b32encode(digest).decode().rstrip("=")
    head = _b64(json.dumps({"typ": "JWT", "alg": "ed25519-nkey"}).encode())
    body = _b64(json.dumps(claims, separators=(",", ":")).encode())
    return f"{head}.{body}.{_b64(issuer.sign(f'{head}.{body}'.encode()))}"


@dataclass(frozen=True)
class Operator:
    """An operator and one account: ``server_config`` trusts them, ``creds`` makes users."""

    operator: Key
    account: Key
    system: Key  # the server's own account (JetStream needs one)
    operator_jwt: str
    account_jwt: str
    system_jwt: str

    @classmethod
    def new(cls) -> Operator:
        op, acc = Key.new(nkeys.PREFIX_BYTE_OPERATOR), Key.new(nkeys.PREFIX_BYTE_ACCOUNT)
        system = Key.new(nkeys.PREFIX_BYTE_ACCOUNT)
        no_jetstream = {**_UNLIMITED, "mem_storage": 0, "disk_storage": 0, "streams": 0, "consumer": 0}
        return cls(
            op, acc, system, jwt(op, op.public, "aisp-test", {"type": "operator"}),
            jwt(op, acc.public, "app", {"type": "account", "limits": _UNLIMITED}),
            jwt(op, system.public, "SYS", {"type": "account", "limits": no_jetstream}),
        )  # fmt: skip

    def server_config(self) -> str:
        """The lines of a nats-server config that trust this operator and know its accounts."""
        return (
            f'operator: "{self.operator_jwt}"\nsystem_account: {self.system.public}\nresolver: MEMORY\n'
            f'resolver_preload: {{ {self.account.public}: "{self.account_jwt}",'
            f' {self.system.public}: "{self.system_jwt}" }}\n'
        )

    def creds(self, path: Path, name: str = "app", *, signer: Key | None = None) -> Path:
        """A credentials file of a new user ``name`` of the account (signed by ``signer``: by
        default the account's key; another key makes a user the server does not trust)."""
        user = Key.new(nkeys.PREFIX_BYTE_USER)
        claims = {"type": "user", "pub": {}, "sub": {}, "subs": -1, "data": -1, "payload": -1}
        token = jwt(signer or self.account, user.public, name, claims)
        path.write_text(
            f"-----BEGIN NATS USER JWT-----\n{token}\n------END NATS USER JWT------\n\n"
            f"-----BEGIN USER NKEY SEED-----\n{user.seed.decode()}\n------END USER NKEY SEED------\n"
        )
        return path
