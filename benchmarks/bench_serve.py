"""`aisp serve` under load, against the HTTP stack's ceiling and an unbatched server.

Part 1, OIP v2 single-row JSON infer (``wrk`` with ``benchmarks/oip_infer.lua``, one wrk thread,
closed loop, ``--seconds`` per point), at concurrency 1, 16, 64, 256, for:

* ``asgi_hello``: a plain ASGI hello-world app on the same server (uvicorn, httptools, uvloop):
  the server's own ceiling; ``hello``: the same endpoint on Starlette;
* ``asgi_unbatched``: a plain ASGI app decoding the same OIP JSON and calling ONNX Runtime per
  request; ``unbatched``: the same on Starlette;
* ``aisp``: ``aisp serve`` on a model repository (dynamic batcher, admission control, metrics);

first with workload F's small fraud MLP, then with a compute-heavy MLP (18 -> 1024 -> 1024 -> 1)
where batching pays; and ``hello`` on granian, for the choice of HTTP server.

Part 2, pipeline ingest: ``aisp serve examples/fraud/pipeline.py`` and a separate client process
(``--ingest-client``) that streams workload-F events over one chunked HTTP request per stream
(``--streams``), reading the ordered NDJSON results as they come. Latency per event runs from
the moment its chunk was written to the moment its result line was read. Runs at full speed,
then paced at 80% of that.

Part 3, with ``--perf-analyzer PATH``: Triton's perf_analyzer (tritonclient[all]==2.41.0),
unmodified, over HTTP and gRPC (on both transports, unary and streaming), against ``aisp serve``
and a grpc.aio server answering a
constant (the Python gRPC stack's ceiling), and with its tensors in system shared memory
(``--shared-memory system``). It needs Debian's libb64-0d and ``libcudart.so.12``
(PyPI's nvidia-cuda-runtime-cu12: put its ``lib`` directory on ``LD_LIBRARY_PATH``).

Every point runs its contenders in turn, ``--rounds`` times (alternating, each round in the
opposite order to the last); the median round is reported, and the median over rounds of each
contender's ratio to the ceiling (``asgi_hello``; ``asgi_unbatched`` for the heavy model) in the
same round.

    python benchmarks/bench_serve.py [--seconds 8] [--events 400000] [--rounds 3] [--perf-analyzer PATH]
        [--skip-infer] [--skip-ingest]
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT))
from benchmarks.workload import mlp_model, write_events  # noqa: E402

PY = sys.executable
ENV = {**os.environ, "PYTHONPATH": f"{ROOT / 'src'}:{ROOT}"}
LUA = ROOT / "benchmarks" / "oip_infer.lua"
CONCURRENCY = (1, 16, 64, 256)


@contextmanager
def server(cmd: list[str], expect: tuple[str, ...] = ("http",)) -> Iterator[Any]:
    """Start a server that prints ``PROTOCOL HOST:PORT`` for each protocol of ``expect``; yield
    the address (several: their tuple, in that order); SIGTERM it after."""
    proc = subprocess.Popen(cmd, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    assert proc.stdout is not None
    try:
        found: dict[str, str] = {}
        while not set(expect) <= set(found):
            line = proc.stdout.readline()
            if not line:
                raise RuntimeError(f"server exited: {cmd}")
            if line.startswith(("http ", "grpc ")):
                found[line.split()[0]] = line.split()[1]
        time.sleep(1.5)  # bound before it serves; let it warm up
        yield found[expect[0]] if len(expect) == 1 else tuple(found[p] for p in expect)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()


_UNITS = {"us": 1e-3, "ms": 1.0, "s": 1e3}


def wrk(address: str, concurrency: int, seconds: float) -> dict[str, float]:
    url = f"http://{address}/v2/models/fraud/infer"
    out = subprocess.run(
        ["wrk", "-t1", f"-c{concurrency}", f"-d{round(seconds)}s", "--latency", "-s", str(LUA), url],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    res: dict[str, float] = {"rps": float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1))}  # type: ignore[union-attr]
    for pct in ("50", "99"):
        m = re.search(rf"\s{pct}%\s+([\d.]+)(us|ms|s)", out)
        res[f"p{pct}_ms"] = float(m.group(1)) * _UNITS[m.group(2)] if m else float("nan")
    errors = re.search(r"Non-2xx or 3xx responses:\s+(\d+)", out)
    res["non_2xx"] = float(errors.group(1)) if errors else 0.0
    return res


def repository(root: Path, model: Path, max_batch: int) -> Path:
    (root / "fraud" / "1").mkdir(parents=True)
    shutil.copy(model, root / "fraud" / "1" / "model.onnx")
    (root / "fraud" / "config.pbtxt").write_text(
        f"""name: "fraud"
platform: "onnxruntime_onnx"
max_batch_size: {max_batch}
input [ {{ name: "features" data_type: TYPE_FP32 dims: [ 18 ] }} ]
output [ {{ name: "score" data_type: TYPE_FP32 dims: [ 1 ] }} ]
dynamic_batching {{ max_queue_delay_microseconds: 500 }}
"""
    )
    return root


def infer_part(seconds: float, tmp: Path, rounds: int) -> dict[str, Any]:
    """Every contender of a model serves at once (idle until its turn); each concurrency level
    runs them in turn, ``rounds`` times, alternating; the median round is reported."""
    heavy = mlp_model(tmp / "heavy.onnx")
    models = {"fraud": ROOT / "examples" / "fraud" / "model.onnx", "heavy": heavy}
    apps = ROOT / "benchmarks" / "serve_apps.py"
    results: dict[str, Any] = {}
    for model_name, model in models.items():
        repo = repository(tmp / f"repo-{model_name}", model, 512)
        contenders = {  # aisp between the two it is compared with: each pair runs back to back
            "asgi_hello": [PY, str(apps), "asgi_hello", "0"],
            "aisp": [PY, "-m", "aisp.cli", "serve", str(repo), "--http-port", "0", "--grpc-port", "-1"],
            "asgi_unbatched": [PY, str(apps), "asgi_unbatched", "0", "uvicorn", str(model)],
            "hello": [PY, str(apps), "hello", "0"],
            "unbatched": [PY, str(apps), "unbatched", "0", "uvicorn", str(model)],
        }
        if model_name == "heavy":  # the stack's ceiling does not depend on the model
            del contenders["hello"], contenders["asgi_hello"]
        with ExitStack() as stack:
            addresses = {name: stack.enter_context(server(cmd)) for name, cmd in contenders.items()}
            for c in CONCURRENCY:
                runs: dict[str, list[dict[str, float]]] = {name: [] for name in contenders}
                order = list(addresses.items())
                for i in range(rounds):  # forward, then backward: the machine's drift hits all alike
                    for name, address in order if i % 2 == 0 else order[::-1]:
                        runs[name].append(wrk(address, c, seconds))
                reference = "asgi_unbatched" if model_name == "heavy" else "asgi_hello"
                for name, rs in runs.items():
                    r = sorted(rs, key=lambda x: x["rps"])[len(rs) // 2]  # the median round
                    r["rps_rounds"] = [x["rps"] for x in rs]  # type: ignore[assignment]
                    # the ratio to the reference in each round (run back to back), median
                    ratios = sorted(x["rps"] / y["rps"] for x, y in zip(rs, runs[reference], strict=True))
                    r[f"ratio_to_{reference}"] = round(ratios[len(ratios) // 2], 3)
                    results[f"{model_name}/{name}/c{c}"] = r
                    print(f"{model_name:6} {name:14} c={c:3}  {r}", flush=True)
    if importlib.util.find_spec("granian") is None:
        print("granian is not installed (pip install -e '.[bench]'): skipping its hello run", flush=True)
        return results
    with server([PY, str(apps), "hello", "18777", "granian"]) as address:
        for c in (64, 256):
            r = wrk(address, c, seconds)
            results[f"granian/hello/c{c}"] = r
            print(f"granian hello     c={c:3}  {r}", flush=True)
    return results


def perf_analyzer_part(binary: str, tmp: Path, rounds: int) -> dict[str, Any]:
    """Triton's perf_analyzer, unmodified, against ``aisp serve`` over HTTP and over gRPC on both
    transports (``aisp``: native, ``aisp-grpcio``: grpc.aio), unary and ModelStreamInfer (batch 1
    at concurrency 16, batch 64 at concurrency 4), and against a grpc.aio server whose ModelInfer
    returns a constant (the Python gRPC stack's own ceiling); alternating, median of ``rounds``.
    ``ratio_to_http``: each gRPC point's median ratio to HTTP's throughput in the same round."""
    repo = repository(tmp / "repo-pa", ROOT / "examples" / "fraud" / "model.onnx", 512)
    aisp = [PY, "-m", "aisp.cli", "serve", str(repo), "--http-port", "0", "--grpc-port", "0"]
    aisp.append("--allow-shared-memory")  # perf_analyzer --shared-memory system registers regions
    grpcio = [*aisp[:5], "--http-port", "-1", "--grpc-port", "0", "--grpc-server", "grpcio"]
    apps = ROOT / "benchmarks" / "serve_apps.py"
    results: dict[str, Any] = {}
    with ExitStack() as stack:
        http, grpc_address = stack.enter_context(server(aisp, ("http", "grpc")))
        grpcio_address = stack.enter_context(server(grpcio, ("grpc",)))
        ceiling = stack.enter_context(server([PY, str(apps), "grpc_hello", "0"], ("grpc",)))
        points = [
            ("aisp/http", http, "http", 1, 16),
            ("aisp/grpc", grpc_address, "grpc", 1, 16),
            ("aisp-grpcio/grpc", grpcio_address, "grpc", 1, 16),
            ("aisp/grpc-stream", grpc_address, "grpc", 1, 16),
            ("aisp-grpcio/grpc-stream", grpcio_address, "grpc", 1, 16),
            ("grpc_hello/grpc", ceiling, "grpc", 1, 16),
            ("aisp/grpc+shm", grpc_address, "grpc", 1, 16),
            ("aisp/http", http, "http", 64, 4),
            ("aisp/grpc", grpc_address, "grpc", 64, 4),
            ("aisp-grpcio/grpc", grpcio_address, "grpc", 64, 4),
            ("aisp/http+shm", http, "http", 64, 4),
            ("aisp/grpc+shm", grpc_address, "grpc", 64, 4),
        ]
        runs: dict[str, list[dict[str, float]]] = {}
        for i in range(rounds):
            for name, address, protocol, batch, c in points if i % 2 == 0 else points[::-1]:
                key = f"{name}/b{batch}/c{c}"
                extra = ["--shared-memory", "system"] if name.endswith("+shm") else []
                extra += ["--streaming"] if name.endswith("-stream") else []
                runs.setdefault(key, []).append(perf_analyzer(binary, address, protocol, batch, c, extra))
        for key, rs in runs.items():
            measured = [x for x in rs if x["infer_per_s"] == x["infer_per_s"]] or rs  # NaN: nothing
            r = sorted(measured, key=lambda x: x["infer_per_s"])[len(measured) // 2]
            http_key = f"aisp/http/{key.rsplit('/', 2)[-2]}/{key.rsplit('/', 1)[-1]}"
            if "grpc" in key.split("/")[1] and http_key in runs:
                pairs = zip(rs, runs[http_key], strict=True)  # the rounds where both measured something
                ratios = sorted(
                    x["infer_per_s"] / y["infer_per_s"]
                    for x, y in pairs
                    if x["infer_per_s"] > 0 < y["infer_per_s"]
                )
                if ratios:
                    r = {**r, "ratio_to_http": round(ratios[len(ratios) // 2], 3)}
            results[key] = r  # perf_analyzer counts inferences as rows: batch 64 is 64 of them
            print(f"perf_analyzer {key:34} {results[key]}", flush=True)
    return results


def perf_analyzer(
    binary: str, address: str, protocol: str, batch: int, c: int, extra: list[str]
) -> dict[str, float]:
    """One perf_analyzer run: its throughput (the last window's when the measurement never
    stabilised, ``stable`` then 0) and p99; NaN throughput if it measured nothing."""
    proc = subprocess.run(
        [
            binary, "-m", "fraud", "-u", address, "-i", protocol, "-b", str(batch),
            "--concurrency-range", str(c), "-s", "40", "--max-trials", "6", "--shape", "features:18", *extra,
        ],
        capture_output=True, text=True,
    )  # fmt: skip
    out = proc.stdout
    summary = re.search(r"Concurrency: \d+, throughput: ([\d.]+) infer/sec", out)
    res = {
        "infer_per_s": float(summary.group(1)) if summary else float("nan"),
        "stable": int(proc.returncode == 0),
    }
    p99 = re.search(r"p99 latency: (\d+) usec", out)
    res["p99_ms"] = int(p99.group(1)) / 1000 if p99 else float("nan")
    if summary is None:
        print(f"perf_analyzer measured nothing: {(proc.stderr or out).strip()[-300:]}", flush=True)
    return res


# -- pipeline ingest ---------------------------------------------------------------------------
async def _stream(host: str, port: int, lines: list[bytes], chunk: int, rate: float) -> dict[str, Any]:
    """One chunked POST of ``lines``; returns counts and per-event latencies (ms)."""
    reader, writer = await asyncio.open_connection(host, port)
    writer.write(
        b"POST /v1/pipelines/fraud/events HTTP/1.1\r\nHost: x\r\nContent-Type: application/x-ndjson\r\n"
        b"Transfer-Encoding: chunked\r\n\r\n"
    )
    sent_at: list[int] = []
    n_chunks = (len(lines) + chunk - 1) // chunk

    async def write() -> None:
        start = time.monotonic_ns()
        for i in range(n_chunks):
            if rate > 0:
                due = start + int(i * chunk / rate * 1e9)
                delay = (due - time.monotonic_ns()) / 1e9
                if delay > 0:
                    await asyncio.sleep(delay)
            body = b"\n".join(lines[i * chunk : (i + 1) * chunk]) + b"\n"
            sent_at.append(time.monotonic_ns())
            writer.write(b"%x\r\n%s\r\n" % (len(body), body))
            await writer.drain()
        writer.write(b"0\r\n\r\n")
        await writer.drain()

    writing = asyncio.create_task(write())
    head = await reader.readuntil(b"\r\n\r\n")
    assert b" 200 " in head.split(b"\r\n")[0], head
    latencies = np.empty(len(lines), dtype=np.float64)
    got, errors, tail = 0, 0, b""
    while True:
        size = int((await reader.readuntil(b"\r\n")).strip(), 16)
        data = await reader.readexactly(size + 2)
        if size == 0:
            break
        now = time.monotonic_ns()
        parts = (tail + data[:-2]).split(b"\n")
        tail = parts.pop()
        for part in parts:
            if part.startswith(b'{"error"'):
                errors += 1
        k = len(parts)
        first_chunk = np.arange(got, got + k) // chunk
        latencies[got : got + k] = (now - np.asarray(sent_at)[first_chunk]) / 1e6
        got += k
    await writing
    writer.close()
    return {"events": got, "errors": errors, "latencies": latencies[:got]}


async def _ingest(address: str, lines: list[bytes], streams: int, chunk: int, rate: float) -> dict[str, Any]:
    host, port = address.rsplit(":", 1)
    per = len(lines) // streams
    started = time.monotonic()
    parts = await asyncio.gather(
        *(
            _stream(host, int(port), lines[i * per : (i + 1) * per], chunk, rate / streams)
            for i in range(streams)
        )
    )
    seconds = time.monotonic() - started
    lat = np.concatenate([p["latencies"] for p in parts])
    return {
        "events": int(sum(p["events"] for p in parts)),
        "errors": int(sum(p["errors"] for p in parts)),
        "seconds": round(seconds, 3),
        "events_per_s": round(sum(p["events"] for p in parts) / seconds),
        "p50_ms": round(float(np.percentile(lat, 50)), 2),
        "p99_ms": round(float(np.percentile(lat, 99)), 2),
        "max_ms": round(float(lat.max()), 2),
    }


def ingest_client() -> None:
    """``--ingest-client ADDRESS FILE STREAMS CHUNK RATE``: print one JSON result line."""
    address, path, streams, chunk, rate = sys.argv[2:7]
    lines = Path(path).read_bytes().splitlines()
    print(json.dumps(asyncio.run(_ingest(address, lines, int(streams), int(chunk), float(rate)))))


def ingest_part(events: int, streams: int, chunk: int, tmp: Path) -> dict[str, Any]:
    data = tmp / "events.jsonl"
    write_events(data, events, seed=0)
    pipeline = ROOT / "examples" / "fraud" / "pipeline.py"
    results: dict[str, Any] = {}
    cmd = [PY, "-m", "aisp.cli", "serve", str(pipeline), "--http-port", "0", "--grpc-port", "-1"]
    rate = 0.0
    for label in ("max", "paced80"):
        with server(cmd) as address:
            client = [
                PY,
                __file__,
                "--ingest-client",
                address,
                str(data),
                str(streams),
                str(chunk),
                str(rate),
            ]
            out = subprocess.run(client, env=ENV, capture_output=True, text=True, check=True).stdout
            r = json.loads(out)
            results[label] = {**r, "rate": rate}
            print(f"ingest {label:8} {results[label]}", flush=True)
            rate = 0.8 * r["events_per_s"]
    return results


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--ingest-client":
        ingest_client()
        return 0
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=int, default=8)
    ap.add_argument("--events", type=int, default=400_000)
    ap.add_argument("--streams", type=int, default=2)
    ap.add_argument("--chunk", type=int, default=1000)
    ap.add_argument("--skip-infer", action="store_true")
    ap.add_argument("--skip-ingest", action="store_true")
    ap.add_argument("--rounds", type=int, default=3, help="alternating rounds per point (median)")
    ap.add_argument("--perf-analyzer", help="Triton's perf_analyzer binary (tritonclient[all]==2.41.0)")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()
    if shutil.which("wrk") is None and not args.skip_infer:
        print("wrk is not installed (Debian: apt-get install wrk)", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        results = {"infer": {} if args.skip_infer else infer_part(args.seconds, tmp, args.rounds)}
        if args.perf_analyzer:
            results["perf_analyzer"] = perf_analyzer_part(args.perf_analyzer, tmp, args.rounds)
        if not args.skip_ingest:
            results["ingest"] = ingest_part(args.events, args.streams, args.chunk, tmp)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
