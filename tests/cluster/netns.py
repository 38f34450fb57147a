"""Hosts made of Linux network namespaces: each has its own network stack and address on a private
bridge, as machines on one switch. The broker host is the root namespace on the bridge's own
address; every other host is a namespace with a veth pair into the bridge.

Faults act on a host's link as they would on a machine's: ``cut`` takes its veth down (nothing in
or out, no reset: connections hang as across a dead switch port), ``restore`` brings it back,
``cap`` limits its bandwidth with a token bucket (``tc tbf``; this kernel has no netem, so delays
go through the project's fault proxy instead).

Everything made here is named after the process (``a<pid>``...) and deleted by ``close``, also
when a test fails (and at interpreter exit as a last resort); what a killed run left is deleted
by the next one (``sweep``). Needs root and iproute2.
"""

from __future__ import annotations

import atexit
import os
import shutil
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["Host", "Network", "unavailable"]


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


def unavailable() -> str | None:
    """Why namespaces cannot be made here (None: they can)."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"network namespaces need iproute2's `{tool}`"
    probe = f"aisp-probe-{os.getpid()}"
    try:
        _ip("netns", "add", probe)
        _ip("netns", "del", probe)
    except subprocess.CalledProcessError as exc:
        return f"`ip netns add` failed: {exc.stderr.strip()}"
    return None


@dataclass
class Host:
    """One host: a namespace (``ns``; None for the broker host, the root namespace), its address,
    and the host side of its link (``veth``)."""

    name: str
    ip: str
    ns: str | None
    veth: str | None
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)

    def command(self, argv: Sequence[str]) -> list[str]:
        return [*(("ip", "netns", "exec", self.ns) if self.ns else ()), *argv]

    def start(
        self, argv: Sequence[str], *, log: Path, env: dict[str, str] | None = None
    ) -> subprocess.Popen[bytes]:
        """Run ``argv`` on this host, its stdout and stderr to ``log``."""
        with log.open("ab") as out:
            proc = subprocess.Popen(self.command(argv), env=env, stdout=out, stderr=subprocess.STDOUT)
        self.procs.append(proc)
        return proc


def sweep() -> None:
    """Delete the bridges and namespaces of processes that are gone (a run killed before its
    ``close``): a stale bridge on the same subnet would take the new one's routes."""
    import re

    links = subprocess.run(["ip", "-o", "link", "show", "type", "bridge"], capture_output=True, text=True)
    for name, pid in re.findall(r"^\d+: (a(\d+)br)[:@]", links.stdout, re.MULTILINE):
        if not Path(f"/proc/{pid}").exists():
            subprocess.run(["ip", "link", "del", name], check=False, capture_output=True)
    spaces = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True)
    for ns, pid in re.findall(r"^(a(\d+)-\S+)", spaces.stdout, re.MULTILINE):
        if not Path(f"/proc/{pid}").exists():
            subprocess.run(["ip", "netns", "del", ns], check=False, capture_output=True)


class Network:
    """A bridge with the broker host on ``.1`` and up to 200 namespace hosts (``add``)."""

    def __init__(self, subnet: int | None = None) -> None:
        sweep()
        pid = os.getpid()
        self._tag = f"a{pid}"
        self.subnet = subnet if subnet is not None else 100 + pid % 150  # 10.<subnet>.7.0/24
        self.prefix = f"10.{self.subnet}.7"
        self.bridge = f"{self._tag}br"
        self.hosts: dict[str, Host] = {}
        self._closed = False
        _ip("link", "add", self.bridge, "type", "bridge")
        atexit.register(self.close)
        _ip("addr", "add", f"{self.prefix}.1/24", "dev", self.bridge)
        _ip("link", "set", self.bridge, "up")
        self.broker = Host("broker", f"{self.prefix}.1", None, None)

    def add(self, name: str) -> Host:
        """A new host ``name`` with the next address."""
        index = len(self.hosts) + 10
        ns, veth = f"{self._tag}-{name}", f"{self._tag}v{index}"
        _ip("netns", "add", ns)
        _ip("link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", ns)
        _ip("link", "set", veth, "master", self.bridge, "up")
        ip = f"{self.prefix}.{index}"
        _ip("-n", ns, "addr", "add", f"{ip}/24", "dev", "eth0")
        _ip("-n", ns, "link", "set", "eth0", "up")
        _ip("-n", ns, "link", "set", "lo", "up")
        host = Host(name, ip, ns, veth)
        self.hosts[name] = host
        return host

    # -- faults ---------------------------------------------------------------------------------
    def cut(self, host: Host) -> None:
        """Nothing in or out of ``host`` (the broker host: of every other host) until ``restore``."""
        for veth in self._links(host):
            _ip("link", "set", veth, "down")

    def restore(self, host: Host) -> None:
        for veth in self._links(host):
            _ip("link", "set", veth, "up")

    def cap(self, host: Host, rate: str = "1mbit") -> None:
        """``host``'s traffic from the bridge limited to ``rate`` (a token bucket)."""
        assert host.veth is not None, "the broker host's link is every link"
        subprocess.run(["tc", "qdisc", "replace", "dev", host.veth, "root", "tbf", "rate", rate,
                        "burst", "32kbit", "latency", "400ms"], check=True, capture_output=True)  # fmt: skip

    def uncap(self, host: Host) -> None:
        assert host.veth is not None
        subprocess.run(["tc", "qdisc", "del", "dev", host.veth, "root"], check=False, capture_output=True)

    def _links(self, host: Host) -> list[str]:
        if host.veth is not None:
            return [host.veth]
        return [h.veth for h in self.hosts.values() if h.veth is not None]

    # -- the end --------------------------------------------------------------------------------
    def close(self) -> None:
        """Stop every process started on a host, delete the namespaces and the bridge."""
        if self._closed:
            return
        self._closed = True
        for host in [*self.hosts.values(), self.broker]:
            for proc in host.procs:
                if proc.poll() is None:
                    proc.kill()
                proc.wait()
        for host in self.hosts.values():
            subprocess.run(["ip", "netns", "del", str(host.ns)], check=False, capture_output=True)
        subprocess.run(["ip", "link", "del", self.bridge], check=False, capture_output=True)

    def __enter__(self) -> Network:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
