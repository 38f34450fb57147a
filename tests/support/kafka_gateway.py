"""A Kafka gateway for tests: TLS and a SASL login (PLAIN, SCRAM-SHA-256, SCRAM-SHA-512) in front of
a broker that has neither (Tansu, the broker the tests run, cannot serve them).

Per connection it answers the SASL exchange itself (``SaslHandshake``, then ``SaslAuthenticate``
rounds: RFC 4616 for PLAIN, RFC 5802/7677 for SCRAM), relays ``ApiVersions`` to the broker (which
lists both SASL requests), refuses anything else before the login, and once the login passed
relays bytes both ways untouched. The broker must advertise the gateway's port, so that clients
come back through it. librdkafka on the other side cannot tell it from a secured broker.

Written here: no maintained Python Kafka broker or SASL proxy installs offline.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import hmac
import os
import ssl
import struct
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

API_VERSIONS, SASL_HANDSHAKE, SASL_AUTHENTICATE = 18, 17, 36
UNSUPPORTED_SASL_MECHANISM, ILLEGAL_SASL_STATE, SASL_AUTHENTICATION_FAILED = 33, 34, 58
MECHANISMS = ("PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512")
_HASH = {"SCRAM-SHA-256": hashlib.sha256, "SCRAM-SHA-512": hashlib.sha512}


@dataclass
class Gateway:
    port: int
    users: dict[str, str]
    logins: list[tuple[str, str, bool]] = field(default_factory=list)
    """(mechanism, user, passed) of every login tried."""


def _string(data: bytes, at: int) -> tuple[str | None, int]:
    (n,) = struct.unpack_from(">h", data, at)
    if n < 0:
        return None, at + 2
    return data[at + 2 : at + 2 + n].decode(), at + 2 + n


def _uvarint(data: bytes, at: int) -> tuple[int, int]:
    shift = value = 0
    while True:
        b = data[at]
        at += 1
        value |= (b & 0x7F) << shift
        if not b & 0x80:
            return value, at
        shift += 7


def _put_uvarint(value: int) -> bytes:
    out = bytearray()
    while True:
        b = value & 0x7F
        value >>= 7
        if value:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def _skip_tags(data: bytes, at: int) -> int:
    count, at = _uvarint(data, at)
    for _ in range(count):
        _, at = _uvarint(data, at)
        size, at = _uvarint(data, at)
        at += size
    return at


class _Scram:
    """The server side of one SCRAM exchange (RFC 5802) for ``users``."""

    def __init__(self, mechanism: str, users: dict[str, str]) -> None:
        self.hash, self.users = _HASH[mechanism], users
        self.user = ""
        self._first_bare = self._server_first = ""
        self._salted = b""

    def _hmac(self, key: bytes, msg: bytes) -> bytes:
        return hmac.new(key, msg, self.hash).digest()

    def first(self, client_first: str) -> str | None:
        bare = client_first.split(",", 2)[2]  # after the gs2 header "n,,"
        attrs = dict(part.split("=", 1) for part in bare.split(","))
        self.user = attrs["n"].replace("=2C", ",").replace("=3D", "=")
        password = self.users.get(self.user)
        salt, iterations = os.urandom(16), 4096
        # an unknown user gets a made-up salt: the exchange fails at its proof, as a real one does
        self._salted = hashlib.pbkdf2_hmac(
            self.hash().name, (password or os.urandom(8).hex()).encode(), salt, iterations
        )
        nonce = attrs["r"] + base64.b64encode(os.urandom(18)).decode()
        self._first_bare = bare
        self._server_first = f"r={nonce},s={base64.b64encode(salt).decode()},i={iterations}"
        return self._server_first

    def final(self, client_final: str) -> str | None:
        without_proof, _, proof = client_final.rpartition(",p=")
        auth = f"{self._first_bare},{self._server_first},{without_proof}".encode()
        client_key = self._hmac(self._salted, b"Client Key")
        stored = self.hash(client_key).digest()
        signature = self._hmac(stored, auth)
        recovered = bytes(a ^ b for a, b in zip(base64.b64decode(proof), signature, strict=True))
        if self.user not in self.users or self.hash(recovered).digest() != stored:
            return None
        return "v=" + base64.b64encode(self._hmac(self._hmac(self._salted, b"Server Key"), auth)).decode()


class _Connection:
    def __init__(self, gateway: Gateway, upstream: tuple[str, int], mechanisms: tuple[str, ...]) -> None:
        self.gateway, self.upstream, self.mechanisms = gateway, upstream, mechanisms
        self.mechanism: str | None = None
        self.scram: _Scram | None = None
        self.up: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None = None

    async def _upstream(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        if self.up is None:
            self.up = await asyncio.open_connection(*self.upstream)
        return self.up

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:  # until the login passed
                size = struct.unpack(">i", await reader.readexactly(4))[0]
                frame = await reader.readexactly(size)
                key, version, corr = struct.unpack_from(">hhi", frame)
                if key == API_VERSIONS:
                    up_reader, up_writer = await self._upstream()
                    up_writer.write(struct.pack(">i", size) + frame)
                    n = struct.unpack(">i", await up_reader.readexactly(4))[0]
                    writer.write(struct.pack(">i", n) + await up_reader.readexactly(n))
                elif key == SASL_HANDSHAKE:
                    mechanism, _ = _string(frame, _string(frame, 8)[1])
                    ok = mechanism in self.mechanisms
                    self.mechanism = mechanism if ok else None
                    names = b"".join(struct.pack(">h", len(m)) + m.encode() for m in self.mechanisms)
                    body = (
                        struct.pack(">hi", 0 if ok else UNSUPPORTED_SASL_MECHANISM, len(self.mechanisms))
                        + names
                    )
                    writer.write(struct.pack(">ii", 4 + len(body), corr) + body)
                elif key == SASL_AUTHENTICATE and self.mechanism is not None:
                    passed = await self._authenticate(frame, version, corr, writer)
                    if passed is False:
                        return
                    if passed:
                        break
                else:
                    return  # anything else before the login: the connection closes
                await writer.drain()
            await writer.drain()
            up_reader, up_writer = await self._upstream()
            await asyncio.gather(_pipe(reader, up_writer), _pipe(up_reader, writer))
        except (asyncio.IncompleteReadError, ConnectionError, ssl.SSLError):
            pass
        finally:
            writer.close()
            if self.up is not None:
                self.up[1].close()

    async def _authenticate(
        self, frame: bytes, version: int, corr: int, writer: asyncio.StreamWriter
    ) -> bool | None:
        """One SaslAuthenticate round: True when the login passed, None when more rounds follow,
        False when it failed (answered, then closed)."""
        at = _string(frame, 8)[1]  # after the client id
        if version >= 2:
            at = _skip_tags(frame, at)
            n, at = _uvarint(frame, at)
            token = frame[at : at + n - 1]
        else:
            (n,) = struct.unpack_from(">i", frame, at)
            token = frame[at + 4 : at + 4 + n]
        reply: str | None
        done = True
        if self.mechanism == "PLAIN":
            _, user, password = token.decode().split("\0")
            ok = self.gateway.users.get(user) == password
            reply = "" if ok else None
            self.gateway.logins.append(("PLAIN", user, ok))
        elif self.scram is None:
            assert self.mechanism is not None
            self.scram = _Scram(self.mechanism, self.gateway.users)
            reply, done = self.scram.first(token.decode()), False
        else:
            reply = self.scram.final(token.decode())
            self.gateway.logins.append((str(self.mechanism), self.scram.user, reply is not None))
        error = 0 if reply is not None else SASL_AUTHENTICATION_FAILED
        message = None if reply is not None else "Authentication failed: invalid credentials"
        out = (reply or "").encode()
        if version >= 2:
            msg = b"\x00" if message is None else _put_uvarint(len(message) + 1) + message.encode()
            body = (
                struct.pack(">h", error)
                + msg
                + _put_uvarint(len(out) + 1)
                + out
                + struct.pack(">q", 0)
                + b"\x00"
            )
            header = struct.pack(">i", corr) + b"\x00"
        else:
            msg = (
                struct.pack(">h", -1)
                if message is None
                else struct.pack(">h", len(message)) + message.encode()
            )
            body = struct.pack(">h", error) + msg + struct.pack(">i", len(out)) + out
            body += struct.pack(">q", 0) if version >= 1 else b""
            header = struct.pack(">i", corr)
        writer.write(struct.pack(">i", len(header) + len(body)) + header + body)
        await writer.drain()
        if reply is None:
            return False
        return True if done else None


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(1 << 16):
            writer.write(data)
            await writer.drain()
    except (ConnectionError, ssl.SSLError):
        pass
    finally:
        writer.close()


@contextmanager
def kafka_gateway(
    upstream: tuple[str, int],
    port: int,
    users: dict[str, str],
    *,
    tls: ssl.SSLContext | None = None,
    mechanisms: tuple[str, ...] = MECHANISMS,
) -> Iterator[Gateway]:
    """A gateway on 127.0.0.1:``port`` to the broker at ``upstream`` that lets ``users`` (name ->
    password) in with one of ``mechanisms``, over TLS with ``tls`` (a server context)."""
    gateway = Gateway(port, users)
    loop = asyncio.new_event_loop()
    server: list[asyncio.AbstractServer] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await _Connection(gateway, upstream, mechanisms).serve(reader, writer)
        except asyncio.CancelledError:  # the gateway stops (asyncio's stream callback would log it)
            writer.close()

    async def start() -> None:
        server.append(await asyncio.start_server(handle, "127.0.0.1", port, ssl=tls))

    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    asyncio.run_coroutine_threadsafe(start(), loop).result(10)

    async def stop() -> None:
        server[0].close()
        tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    try:
        yield gateway
    finally:
        asyncio.run_coroutine_threadsafe(stop(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5)
        loop.close()
