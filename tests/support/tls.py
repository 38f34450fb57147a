"""Throwaway certificates for tests of TLS, made with the openssl command line: a CA, and server
and client certificates it signs (the server's valid for 127.0.0.1 and localhost)."""

from __future__ import annotations

import subprocess
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Pair:
    cert: Path
    key: Path


def _openssl(*args: str) -> None:
    subprocess.run(["openssl", *args], check=True, capture_output=True)


def make_ca(where: Path, name: str = "ca") -> Pair:
    where.mkdir(parents=True, exist_ok=True)
    ca = Pair(where / f"{name}.pem", where / f"{name}.key")
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", f"/CN=aisp test {name}",
             "-keyout", str(ca.key), "-out", str(ca.cert))  # fmt: skip
    return ca


def issue(ca: Pair, where: Path, name: str, *, server: bool) -> Pair:
    """A certificate for ``name`` signed by ``ca`` (a server's: for 127.0.0.1 and localhost)."""
    pair = Pair(where / f"{name}.pem", where / f"{name}.key")
    csr = where / f"{name}.csr"
    _openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", f"/CN={name}", "-keyout", str(pair.key),
             "-out", str(csr))  # fmt: skip
    ext = where / f"{name}.ext"
    usage = "serverAuth" if server else "clientAuth"
    alt = "subjectAltName=IP:127.0.0.1,DNS:localhost\n" if server else ""
    ext.write_text(f"{alt}extendedKeyUsage={usage}\n")
    _openssl("x509", "-req", "-in", str(csr), "-CA", str(ca.cert), "-CAkey", str(ca.key), "-CAcreateserial",
             "-days", "2", "-extfile", str(ext), "-out", str(pair.cert))  # fmt: skip
    return pair
