"""Chaos scenarios that prove recovery: kill a pipeline at random moments, take its broker away.

Each scenario runs a pipeline file as ``aisp run`` in a subprocess (the way users run it) on a
JSON-lines data file, once uninterrupted to a file (the reference) and once through the
scenario, through a file or a broker (``via``: ``file``, ``redis``, ``nats``, ``kafka``: each
through its connector, ``aisp.connectors``; a broker every machine runs, or one started for the
scenario, such as Tansu for Kafka unless ``bootstrap`` names one), with
``--checkpoint-dir``. It then compares the two outputs by ``key`` and reports events lost,
duplicated and with different values, the faults injected and the time each restart took to
recover (from the restart to its first new checkpoint).

* ``kill_scenario``: SIGKILL the run ``kills`` times at random moments, restart it each time.
* ``outage_scenario``: a ``FaultProxy`` between the run and its broker refuses and resets every
  connection for ``down_s`` seconds mid-run, then lets traffic through again.
* ``model_scenario``: the model, served by ``aisp serve`` and called over gRPC through a
  ``FaultProxy``, turns slow or fails for a while; events come out once or are dead-lettered.
* ``restart_scenario``: the broker process itself (a private one, keeping its data on disk) is
  SIGKILLed mid-run and started again ``down_s`` seconds later.

``aisp chaos kill|outage`` runs them from the command line; ``make chaos`` runs the full set.
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from aisp.connectors import connector_for
from aisp.connectors.base import DEFAULT_SHAPE, ScenarioShape, free_port
from aisp.errors import ConfigError
from aisp.faults.outputs import compare, without_dead_letters

__all__ = ["ChaosReport", "kill_scenario", "model_scenario", "outage_scenario", "restart_scenario"]


@dataclass
class ChaosReport:
    """What a scenario did and what came out of it."""

    scenario: str
    via: str
    expected: int
    outputs: int
    lost: int
    duplicates: int
    wrong_values: int
    faults: int
    recover_s: list[float] = field(default_factory=list)
    seconds: float = 0.0
    dead_lettered: int = 0
    """Events the pipeline dead-lettered (with their cause) instead of writing: accounted for."""

    @property
    def passed(self) -> bool:
        return self.lost == 0 and self.duplicates == 0 and self.wrong_values == 0 and self.outputs > 0

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "passed": self.passed}


# -- where events come from and go to ----------------------------------------------------------


class _Endpoints:
    """Input and output of a scenario's run, through the connector of ``via``: the URLs the
    pipeline uses (on the broker at ``address``: maybe a fault proxy) and the same ones the
    scenario fills, reads and drops (at ``direct``, the broker itself)."""

    def __init__(self, via: str, work: Path, address: str, direct: str, shape: ScenarioShape) -> None:
        self.via, self.work, self.shape = via, work, shape
        self.connector = connector_for(f"{via}://")
        tag = uuid.uuid4().hex[:8].upper()
        self._urls = self.connector.scenario_urls(address, tag, shape)
        self._direct = self.connector.scenario_urls(direct, tag, shape)

    def urls(self) -> tuple[str, str]:
        return self._urls

    def fill(self, lines: Sequence[bytes]) -> None:
        self.connector.fill(self._direct[0], lines, self.shape)

    def read(self) -> list[bytes]:
        return self.connector.read(self._direct[1])

    def drop(self) -> None:
        for url in self._direct:
            self.connector.drop(url)


@contextmanager
def _broker(via: str, work: Path, bootstrap: str = "") -> Iterator[str]:
    """Where a scenario's events go: ``work`` for files, ``bootstrap`` if given, the broker every
    machine runs for the scheme, or else a private broker started for the scenario."""
    connector = connector_for(f"{via}://")
    if via == "file":
        yield str(work)
    elif bootstrap or connector.shared_address:
        yield bootstrap or str(connector.shared_address)
    else:
        with connector.private_broker(work / "broker") as broker:
            yield broker.address


# -- running -----------------------------------------------------------------------------------
def _env() -> dict[str, str]:
    src = str(Path(__file__).resolve().parents[2])
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [src, os.environ.get("PYTHONPATH")]))}


def _aisp_run(pipeline: str, source: str, output: str, *extra: str) -> list[str]:
    """``aisp run`` as a command line (``extra``: more options)."""
    cmd = [sys.executable, "-m", "aisp.cli", "run", pipeline, "--no-live", "--input", source]
    return [*cmd, "--output", output, *extra]


def _newest_checkpoint(directory: Path) -> str:
    names = sorted(p.name for p in directory.glob("chk-*")) if directory.exists() else []
    return names[-1] if names else ""


def _second_checkpoint(directory: Path, proc: subprocess.Popen[bytes], deadline: float) -> None:
    """Wait until ``directory`` holds a checkpoint after the run's first (which a fresh run takes
    at once, before it reads anything): one interval in, the run is up."""
    first = ""
    while proc.poll() is None and time.monotonic() < deadline:
        newest = _newest_checkpoint(directory)
        if newest and not first:
            first = newest
        elif newest != first:
            return
        time.sleep(0.02)


@contextmanager
def _scenario(
    pipeline: str | Path,
    data: str | Path,
    via: str,
    work: Path,
    address: str,
    direct: str = "",
    shape: ScenarioShape = DEFAULT_SHAPE,
) -> Iterator[tuple[_Endpoints, list[bytes]]]:
    """Reference output, then the chaos run's endpoints (filled), dropped at the end."""
    shutil.rmtree(work / "checkpoints", ignore_errors=True)  # a reused work directory starts afresh
    work.mkdir(parents=True, exist_ok=True)
    ref = work / "reference.jsonl"
    res = subprocess.run(
        _aisp_run(str(pipeline), str(data), str(ref)), env=_env(), capture_output=True, text=True, check=False
    )
    if res.returncode != 0:
        raise ConfigError(f"the reference run failed: {res.stderr[-2000:]}")
    ends = _Endpoints(via, work, address, direct or address, shape)
    ends.fill(Path(data).read_bytes().splitlines())
    try:
        yield ends, ref.read_bytes().splitlines()
    finally:
        ends.drop()


def kill_scenario(
    pipeline: str | Path,
    data: str | Path,
    *,
    via: str = "file",
    kills: int = 5,
    seed: int = 0,
    rate: float = 20_000,
    checkpoint_interval_s: float = 0.5,
    key: str = "id",
    work: str | Path,
    window_s: tuple[float, float] = (1.0, 3.0),
    bootstrap: str = "",
    shape: ScenarioShape = DEFAULT_SHAPE,
    extra: Sequence[str] = (),
    run_timeout_s: float = 600,
) -> ChaosReport:
    """SIGKILL ``aisp run`` ``kills`` times at random moments (``window_s`` after each start),
    restart it each time, and compare the final output with an uninterrupted run. ``shape``:
    the input's partitions, its group, transactional outputs; ``extra``: more ``aisp run``
    options (``--partition-state changelog``, ...). A last run that has not ended after
    ``run_timeout_s`` is a failure whose message holds its threads' stacks."""
    work = Path(work)
    rng = random.Random(seed)
    started = time.monotonic()
    with (
        _broker(via, work, bootstrap) as address,
        _scenario(pipeline, data, via, work, address, shape=shape) as (ends, reference),
    ):
        source, output = ends.urls()
        chk = work / "checkpoints"
        cmd = _aisp_run(str(pipeline), source, output, "--checkpoint-dir", str(chk), *extra)
        cmd += ["--checkpoint-interval-s", str(checkpoint_interval_s), "--rate", str(rate)]
        done, recover = 0, []
        while True:
            before = _newest_checkpoint(chk)
            t0 = time.monotonic()
            log = work / f"run-{done}.log"  # each run's messages (a pipe nobody reads could fill up)
            with log.open("wb") as err:
                proc = subprocess.Popen(cmd, env=_env(), stdout=subprocess.DEVNULL, stderr=err)
            if done:  # a restart: recovered at its first checkpoint (progress is saved again)
                while (
                    proc.poll() is None and _newest_checkpoint(chk) == before and time.monotonic() - t0 < 60
                ):
                    time.sleep(0.02)
                recover.append(round(time.monotonic() - t0, 3))
            if done < kills:
                time.sleep(max(0.0, rng.uniform(*window_s) - (time.monotonic() - t0)))
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
                    done += 1
                    continue
            rc = _wait_or_dump(proc, run_timeout_s)
            if rc != 0:
                why = f"did not end within {run_timeout_s:g} s" if rc == -9 else f"failed (exit {rc})"
                tail = log.read_text(errors="replace")[-6000:]
                raise ConfigError(f"the chaos run {why} ({log}): {tail}")
            break
        outputs = ends.read()
    lost, dups, wrong = compare(reference, outputs, key)
    return ChaosReport(
        "kill",
        via,
        len(reference),
        len(outputs),
        lost,
        dups,
        wrong,
        done,
        recover,
        time.monotonic() - started,
    )


def _wait_or_dump(proc: subprocess.Popen[bytes], timeout_s: float) -> int:
    """``proc``'s exit code; if it runs past ``timeout_s``, its threads' stacks go to its stderr
    (``aisp`` dumps them on SIGUSR1), it is killed, and the exit code says so (-9)."""
    try:
        return proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        if hasattr(signal, "SIGUSR1"):
            proc.send_signal(signal.SIGUSR1)
            time.sleep(1.0)
        proc.kill()
        proc.wait()
        sys.stderr.write(f"chaos: a run did not end within {timeout_s:g} s; killed\n")
        return -9


def outage_scenario(
    pipeline: str | Path,
    data: str | Path,
    *,
    via: str = "redis",
    down_s: float = 3.0,
    after_s: float = 2.0,
    rate: float = 20_000,
    checkpoint_interval_s: float = 0.5,
    key: str = "id",
    work: str | Path,
    mode: str = "refuse",
    shape: ScenarioShape = DEFAULT_SHAPE,
    extra: Sequence[str] = (),
    run_timeout_s: float = 600,
) -> ChaosReport:
    """Degrade the path to the broker for ``down_s`` seconds, ``after_s`` into processing; the run
    must ride it out and end with exactly-once output. ``mode``: ``refuse`` (refuse and reset
    every connection), ``blackhole`` (accept and swallow everything), ``slow`` (50 ms delay with
    50 ms jitter per chunk each way), ``narrow`` (64 KB/s each way) or ``flaky`` (2% of the
    chunks forwarded drop their connection). ``shape`` and ``extra`` as for ``kill_scenario``;
    a run that has not ended ``run_timeout_s`` after the outage is a failure with its stacks."""
    from aisp.faults.proxy import FaultProxy

    if via == "file":
        raise ConfigError("an outage needs a broker: via redis, nats or kafka, not file")
    faults: dict[str, dict[str, Any]] = {
        "refuse": {"refuse": True},
        "blackhole": {"blackhole": True},
        "slow": {"delay_ms": 50.0, "jitter_ms": 50.0},
        "narrow": {"bandwidth_bytes_per_s": 65536.0},
        "flaky": {"drop": 0.02},
    }
    if mode not in faults:
        raise ConfigError(f"mode must be one of {sorted(faults)}, got {mode!r}")

    def outage() -> None:
        proxy.set(**faults[mode])
        if mode in ("refuse", "blackhole"):
            proxy.reset_connections()
        time.sleep(down_s)
        proxy.clear()
        if mode == "blackhole":  # connections opened into the hole are dead: start afresh
            proxy.reset_connections()

    work = Path(work)
    connector = connector_for(f"{via}://")
    shared = connector.shared_address
    upstream = shared or f"127.0.0.1:{free_port()}"
    host, _, port = upstream.rpartition(":")
    proxy = FaultProxy((host, int(port))).start()
    try:
        with ExitStack() as stack:
            address = direct = f"127.0.0.1:{proxy.port}"
            if shared:
                direct = shared
            else:  # a broker of its own, which tells clients to go through the proxy
                broker = connector.private_broker(work / "broker", port=int(port), advertised_port=proxy.port)
                address = direct = stack.enter_context(broker).address
            ends, reference = stack.enter_context(
                _scenario(pipeline, data, via, work, address, direct, shape=shape)
            )
            return _one_fault(
                f"outage-{mode}", ends, reference, pipeline, outage,
                after_s=after_s, rate=rate, checkpoint_interval_s=checkpoint_interval_s, key=key,
                extra=extra, run_timeout_s=run_timeout_s,
            )  # fmt: skip
    finally:
        proxy.stop()


def _one_fault(
    name: str,
    ends: _Endpoints,
    reference: list[bytes],
    pipeline: str | Path,
    fault: Any,
    *,
    after_s: float,
    rate: float,
    checkpoint_interval_s: float,
    key: str,
    extra: Sequence[str] = (),
    run_timeout_s: float = 600,
) -> ChaosReport:
    """Run the pipeline with checkpoints, call ``fault()`` ``after_s`` after its second checkpoint
    (the pipeline is up: start-up time varies), time the recovery (to the first checkpoint after
    the fault) and compare the output; events that were dead-lettered (``dead-letters.jsonl``,
    by ``id``) count as accounted for, not lost. The run's messages go to ``run.log`` (a pipe
    nobody reads while the fault lasts could fill up and stall it); a run that has not ended
    ``run_timeout_s`` after the fault is a failure whose message holds its threads' stacks."""
    started = time.monotonic()
    source, output = ends.urls()
    chk = ends.work / "checkpoints"
    dead = ends.work / "dead-letters.jsonl"
    cmd = _aisp_run(str(pipeline), source, output, "--checkpoint-dir", str(chk), "--dead-letter", str(dead))
    cmd += list(extra)
    cmd += ["--checkpoint-interval-s", str(checkpoint_interval_s), "--rate", str(rate)]
    log = ends.work / "run.log"
    with log.open("wb") as err:
        proc = subprocess.Popen(cmd, env=_env(), stdout=subprocess.DEVNULL, stderr=err)
    deadline = time.monotonic() + 120
    _second_checkpoint(chk, proc, deadline)
    time.sleep(after_s)
    if proc.poll() is not None:  # a fault after the end would prove nothing
        raise ConfigError(
            f"the chaos run ended (exit {proc.returncode}) before the fault, {after_s:g} s after its"
            f" second checkpoint: strike earlier or pace the input slower ({log})"
        )
    fault()
    back = time.monotonic()
    before = _newest_checkpoint(chk)
    while (
        proc.poll() is None and _newest_checkpoint(chk) == before and time.monotonic() - back < run_timeout_s
    ):
        time.sleep(0.02)
    recover = [round(time.monotonic() - back, 3)]
    rc = _wait_or_dump(proc, max(1.0, run_timeout_s - (time.monotonic() - back)))
    if rc != 0:
        why = f"did not end within {run_timeout_s:g} s of the fault" if rc == -9 else f"failed (exit {rc})"
        raise ConfigError(f"the chaos run {why} ({log}): {log.read_text(errors='replace')[-6000:]}")
    outputs = ends.read()
    kept = without_dead_letters(reference, dead.read_bytes().splitlines(), key)
    lost, dups, wrong = compare(kept, outputs, key)
    seconds = time.monotonic() - started
    report = ChaosReport(name, ends.via, len(reference), len(outputs), lost, dups, wrong, 1, recover, seconds)
    report.dead_lettered = len(reference) - len(kept)
    return report


def restart_scenario(
    pipeline: str | Path,
    data: str | Path,
    *,
    via: str = "nats",
    down_s: float = 2.0,
    after_s: float = 2.0,
    rate: float = 20_000,
    checkpoint_interval_s: float = 0.5,
    key: str = "id",
    work: str | Path,
) -> ChaosReport:
    """SIGKILL the broker itself ``after_s`` into processing and start it again ``down_s`` later
    (a private broker that keeps its data on disk); the run must resume by itself and end with
    exactly-once output."""
    work = Path(work)
    with connector_for(f"{via}://").private_broker(work / "broker") as broker:
        if not broker.durable:
            raise ConfigError(f"a broker restart needs a broker that keeps its data on disk, not via {via}")
        with _scenario(pipeline, data, via, work, broker.address) as (ends, reference):
            return _one_fault(
                "restart", ends, reference, pipeline, lambda: broker.restart(down_s),
                after_s=after_s, rate=rate, checkpoint_interval_s=checkpoint_interval_s, key=key,
            )  # fmt: skip


def model_scenario(
    pipeline: str | Path,
    data: str | Path,
    repository: str | Path,
    *,
    fault: str = "slow",
    delay_ms: float = 200.0,
    down_s: float = 3.0,
    after_s: float = 2.0,
    rate: float = 20_000,
    checkpoint_interval_s: float = 0.5,
    key: str = "id",
    work: str | Path,
) -> ChaosReport:
    """The pipeline calls its model on ``aisp serve REPOSITORY`` over gRPC (``--param
    model_url=...``) through a fault proxy; ``after_s`` into the run the model becomes slow
    (``delay_ms`` on every exchange) or fails (connections refused) for ``down_s`` seconds.
    Every event must come out once or be dead-lettered with the cause; nothing is lost."""
    from aisp.faults.proxy import FaultProxy

    if fault not in ("slow", "failing"):
        raise ConfigError(f"fault must be slow or failing, got {fault!r}")
    work = Path(work)
    serve = [
        sys.executable,
        "-m",
        "aisp.cli",
        "serve",
        str(repository),
        "--http-port",
        "-1",
        "--grpc-port",
        "0",
    ]
    server = subprocess.Popen(serve, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        assert server.stdout is not None
        line = server.stdout.readline()
        if not line.startswith("grpc "):
            raise ConfigError("aisp serve did not start")
        host, _, port = line.split()[1].rpartition(":")
        proxy = FaultProxy((host, int(port))).start()

        def model_fault() -> None:
            if fault == "slow":
                proxy.set(delay_ms=delay_ms)
            else:
                proxy.set(refuse=True)
                proxy.reset_connections()
            time.sleep(down_s)
            proxy.clear()

        try:
            with _scenario(pipeline, data, "file", work, str(work)) as (ends, reference):
                return _one_fault(
                    f"model-{fault}", ends, reference, pipeline, model_fault,
                    after_s=after_s, rate=rate, checkpoint_interval_s=checkpoint_interval_s, key=key,
                    extra=["--param", f"model_url=127.0.0.1:{proxy.port}"],
                )  # fmt: skip
        finally:
            proxy.stop()
    finally:
        server.terminate()
        server.communicate(timeout=30)  # also closes its stdout pipe
