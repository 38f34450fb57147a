"""The interface of a connector: one URL scheme, everything AISP does with it.

A connector turns a URL into the pipeline's ends (``source``, ``sink``) and into a stream of
records written once each by key (``record_sink``: dead letters and drift alerts), and gives the
helpers that tests, ``aisp chaos`` and ``aisp bench`` need: the input and output URLs of a
scenario, filling an input, reading an output, dropping both, a private broker of this machine's
own, and an async load client. What a scheme cannot do raises ``ConfigError`` saying so.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar, Protocol

import msgspec

from aisp.errors import ConfigError
from aisp.ingest.base import Source
from aisp.sinks.base import Sink
from aisp.sinks.deadletter import DeadLetterSink

__all__ = [
    "DEFAULT_SHAPE",
    "Connector",
    "LoadClient",
    "Pipeline",
    "PrivateBroker",
    "ScenarioShape",
    "binary",
    "broker_process",
    "free_port",
    "wait_for_port",
]


class Pipeline(Protocol):
    """What a connector needs of a pipeline (``aisp.Pipeline`` has it): its name, the schema its
    input decodes to, and the columns its output writes."""

    @property
    def name(self) -> str: ...
    @property
    def input_schema(self) -> type[msgspec.Struct] | None: ...
    @property
    def output_columns(self) -> list[str] | None: ...


@dataclass(frozen=True)
class PrivateBroker:
    """A broker started for a scenario or a test: where it listens (``HOST:PORT``), and
    ``restart(down_s)``: SIGKILL it and start it again ``down_s`` later (with its data)."""

    address: str
    restart: Callable[[float], None]
    durable: bool = True
    """Whether it keeps its data across a restart."""


@dataclass(frozen=True, kw_only=True)
class ScenarioShape:
    """How a scenario lays out its input and output (``scenario_urls``, ``fill``)."""

    partitions: int = 1
    """Input partitions: each event goes to one by the hash of its ``key`` field (a scheme with
    one ordered input per URL takes 1 only)."""
    key: str = "user"
    group: bool = True
    """Name a consumer group (durable) of the scenario's own in the input URL; False: leave the
    scheme's default."""
    transactional: bool = True
    """Write outputs in transactions where the scheme has them (Kafka); False: its plain
    (idempotent) producer."""

    def __post_init__(self) -> None:
        if not 1 <= self.partitions <= 64:
            raise ConfigError(f"partitions must be an integer from 1 to 64, got {self.partitions}")


DEFAULT_SHAPE = ScenarioShape()


class LoadClient(abc.ABC):
    """The broker end of an open-loop load (``aisp bench`` on a broker URL): events go into the
    pipeline's input, results are read from its output. ``url`` names both:
    ``SCHEME://HOST:PORT/IN?output=OUT``."""

    @abc.abstractmethod
    async def connect(self) -> None:
        """Connect, and read results from now on."""

    @abc.abstractmethod
    async def publish(self, events: list[bytes]) -> None: ...

    @abc.abstractmethod
    async def results(self) -> list[bytes]:
        """Result payloads that arrived (waits briefly when there are none)."""

    @abc.abstractmethod
    async def close(self) -> None: ...


class Connector(abc.ABC):
    """One URL scheme (see the module docstring)."""

    scheme: ClassVar[str]
    shared_address: ClassVar[str | None] = None
    """The broker every development and CI machine runs (``HOST:PORT``); None: start a private
    one for a scenario (``private_broker``)."""

    def _cannot(self, what: str) -> ConfigError:
        return ConfigError(f"{self.scheme}:// URLs cannot be used {what}")

    # -- the pipeline's ends -----------------------------------------------------------------
    def source(self, url: str, schema: type[msgspec.Struct]) -> Source:
        """A source for ``url`` decoding events with ``schema``."""
        raise self._cannot("as an input")

    def sink(self, url: str, columns: Sequence[str] | None) -> Sink:
        """A sink for ``url`` writing ``columns`` (None: all user columns)."""
        raise self._cannot("as an output")

    def record_sink(self, url: str) -> Sink:
        """A sink whose writer has ``write_lines(keys, lines)`` and stores each key once: where
        dead letters and drift alerts go on a broker. Builds the config only (connects on
        ``open``)."""
        raise self._cannot("for dead letters or alerts (they go to redis:// or nats:// streams)")

    def dead_letter_sink(self, url: str) -> DeadLetterSink:
        return DeadLetterSink(stream=self.record_sink(url))

    # -- tests, chaos and bench ---------------------------------------------------------------
    def scenario_urls(self, address: str, tag: str, shape: ScenarioShape = DEFAULT_SHAPE) -> tuple[str, str]:
        """The input and output URLs of a scenario's run on the broker at ``address`` (a
        directory for files), named by ``tag`` and laid out as ``shape`` says; inputs end after
        2 s without a new event."""
        raise self._cannot("in scenarios")

    def fill(self, url: str, lines: Sequence[bytes], shape: ScenarioShape = DEFAULT_SHAPE) -> None:
        """Put ``lines`` (one event each) into the input ``url``, creating it with
        ``shape.partitions`` partitions."""
        raise self._cannot("in scenarios")

    def _one_partition(self, shape: ScenarioShape) -> None:
        if shape.partitions != 1:
            raise ConfigError(f"{self.scheme}:// inputs have one partition, not {shape.partitions}")

    def read(self, url: str) -> list[bytes]:
        """Everything written to the output ``url``, in order."""
        raise self._cannot("in scenarios")

    def drop(self, url: str) -> None:
        """Delete the input or output ``url`` and what a sink kept beside it (dedupe keys)."""
        raise self._cannot("in scenarios")

    def private_broker(
        self, store: Path, *, port: int | None = None, advertised_port: int | None = None
    ) -> AbstractContextManager[PrivateBroker]:
        """A broker of this machine's own on ``port`` (default: a free one) keeping its data in
        ``store``; ``advertised_port``: where clients are told to reconnect (a fault proxy)."""
        raise self._cannot("with a private broker")

    def load_client(self, url: str) -> LoadClient:
        raise self._cannot("as a load target")


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def wait_for_port(port: int, alive: Callable[[], bool], what: str, timeout_s: float = 10.0) -> None:
    """Wait until something accepts connections on 127.0.0.1:``port`` (``alive()``: the process
    that should is still running)."""
    import socket
    import time

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return
        except OSError:
            if time.monotonic() > deadline or not alive():
                raise ConfigError(f"{what} did not start on port {port}") from None
            time.sleep(0.05)


@contextmanager
def broker_process(cmd: list[str], port: int, what: str) -> Iterator[PrivateBroker]:
    """Run ``cmd`` (a broker listening on 127.0.0.1:``port``) until the block ends; its
    ``restart`` SIGKILLs it and starts ``cmd`` again."""
    import signal
    import subprocess
    import time

    def start() -> subprocess.Popen[bytes]:
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_for_port(port, lambda: proc.poll() is None, what)
        return proc

    procs = [start()]

    def restart(down_s: float) -> None:
        procs[-1].send_signal(signal.SIGKILL)
        procs[-1].wait()
        time.sleep(down_s)
        procs.append(start())

    try:
        yield PrivateBroker(f"127.0.0.1:{port}", restart)
    finally:
        procs[-1].kill()
        procs[-1].wait()


def binary(name: str, fallback: str) -> str:
    """The path of the program ``name`` (``fallback`` where Debian puts it outside PATH);
    ConfigError when neither exists."""
    import shutil

    path = shutil.which(name) or fallback
    if not Path(path).exists():
        raise ConfigError(f"no {name} on this machine to run a private broker")
    return path
