"""`aisp serve --tls-cert/--tls-key`: HTTPS and gRPC over TLS with a certificate made here."""

from __future__ import annotations

import os
import ssl
import subprocess
import sys
from pathlib import Path

import httpx
import numpy as np
import tritonclient.grpc as tc

from tests.support.models import fraud_repository
from tests.support.serving import ROOT, aisp_serve


def self_signed(tmp_path: Path) -> tuple[Path, Path]:
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-days",
            "1",
            "-subj",
            "/CN=localhost",
            "-addext",
            "subjectAltName=IP:127.0.0.1,DNS:localhost",
            "-keyout",
            str(key),
            "-out",
            str(cert),
        ],
        check=True,
        capture_output=True,
    )
    return cert, key


def test_https_and_grpc_tls(tmp_path: Path) -> None:
    cert, key = self_signed(tmp_path)
    repo = fraud_repository(tmp_path / "repo", {1: 0.1})
    args = ("--tls-cert", str(cert), "--tls-key", str(key))
    with aisp_serve(repo, http=True, grpc=True, extra_args=args) as (addrs, _):
        url = f"https://{addrs['http']}/v2/health/ready"
        for _ in range(100):
            try:
                r = httpx.get(url, verify=ssl.create_default_context(cafile=str(cert)), timeout=2)
                break
            except httpx.ConnectError:
                continue
        assert r.status_code == 200
        try:
            httpx.get(f"http://{addrs['http']}/v2/health/ready", timeout=2)
            plain_ok = True
        except httpx.TransportError:
            plain_ok = False
        assert not plain_ok, "plain HTTP must not be served when TLS is on"
        client = tc.InferenceServerClient(addrs["grpc"], ssl=True, root_certificates=str(cert))
        inp = tc.InferInput("features", [1, 18], "FP32")
        inp.set_data_from_numpy(np.zeros((1, 18), np.float32))
        assert client.infer("fraud", [inp]).as_numpy("score").shape == (1, 1)


def test_the_native_grpc_transport_refuses_tls_clearly(tmp_path: Path) -> None:
    """``auto`` serves TLS on grpcio (above); asking for the native transport with TLS is an error
    that says why, before anything is served."""
    cert, key = self_signed(tmp_path)
    repo = fraud_repository(tmp_path / "repo", {1: 0.1})
    cmd = [sys.executable, "-m", "aisp.cli", "serve", str(repo), "--grpc-server", "native"]
    cmd += ["--tls-cert", str(cert), "--tls-key", str(key), "--http-port", "0", "--grpc-port", "0"]
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert "native gRPC transport has no TLS" in proc.stderr
    assert "http " not in proc.stdout and "grpc " not in proc.stdout
