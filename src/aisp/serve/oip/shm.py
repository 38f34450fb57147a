"""Triton's system shared-memory extension: tensors passed through POSIX shared memory.

A local client creates a shared-memory object (``shm_open``: ``/dev/shm/KEY``), registers a
region of it under a name (``register``), and then names the region in an input's or a requested
output's parameters (``shared_memory_region``, ``shared_memory_byte_size``, optional
``shared_memory_offset``) instead of sending the tensor's bytes: the server reads the input from
the region and writes the output into it. The regions are shared by the HTTP and gRPC servers.

The server reads and writes with ``pread`` / ``pwrite`` on the object's file descriptor, never
through a mapping: a client that shrinks the object after registering it gets a clear error for
the request, where a mapping would kill the server with SIGBUS. Keys are single names (no path);
symbolic links and anything but a regular file are refused. Registration is off unless the
server is started with it (``aisp serve --allow-shared-memory``), as in Triton.
"""

from __future__ import annotations

import os
import re
import stat
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from aisp.errors import BadRequest, Forbidden, NotFound

__all__ = ["CUDA_SHM_UNSUPPORTED", "NO_REGIONS", "SHM_OFF", "ShmRef", "SharedMemoryRegions", "shm_ref"]

SHM_OFF = (
    "system shared memory is off on this server (start it with --allow-shared-memory to let local"
    " clients register regions)"
)
CUDA_SHM_UNSUPPORTED = (
    "CUDA shared memory is not supported by this server; system shared memory is (--allow-shared-memory)"
)
"""Why a CUDA shared-memory registration is refused: its status lists no region and unregistering
succeeds, as on a Triton server with no CUDA region, so clients that clean up both kinds work."""
SHM_DIR = "/dev/shm"
_KEY = re.compile(r"/?([A-Za-z0-9_.@:+-]{1,250})")
_NAME_LIMIT = 256
_PARAMS = ("shared_memory_region", "shared_memory_offset", "shared_memory_byte_size")


@dataclass(frozen=True, slots=True)
class ShmRef:
    """A tensor's place in a registered region: ``byte_size`` bytes from ``offset``."""

    region: str
    offset: int
    byte_size: int


def shm_ref(params: Mapping[str, Any], where: str) -> ShmRef | None:
    """The shared-memory place an input's or output's ``parameters`` name; None if they name
    none. ``shared_memory_region`` and ``shared_memory_byte_size`` go together; the offset is
    optional (0)."""
    region = params.get("shared_memory_region")
    if region is None:
        for key in _PARAMS[1:]:
            if key in params:
                raise BadRequest(f"{where}: {key!r} can not be specified without 'shared_memory_region'")
        return None
    if type(region) is not str or not region:
        raise BadRequest(f"{where}: 'shared_memory_region' must be a region name, got {region!r}")
    if "shared_memory_byte_size" not in params:
        raise BadRequest(f"{where}: 'shared_memory_byte_size' must be specified with 'shared_memory_region'")
    return ShmRef(
        region,
        _uint(params.get("shared_memory_offset", 0), f"{where}: 'shared_memory_offset'"),
        _uint(params["shared_memory_byte_size"], f"{where}: 'shared_memory_byte_size'"),
    )


def _uint(value: Any, what: str) -> int:
    if type(value) is not int or not 0 <= value < 2**63:
        raise BadRequest(f"{what} must be an integer from 0 to {2**63 - 1}, got {value!r}")
    return value


@dataclass
class _Region:
    name: str
    key: str
    offset: int
    byte_size: int
    fd: int


class SharedMemoryRegions:
    """The registered system shared-memory regions of one server (thread-safe: the HTTP and
    gRPC servers run on threads of their own). ``allowed=False``: every registration is
    refused (403) and the status lists no region."""

    def __init__(self, *, allowed: bool = True, directory: str = SHM_DIR) -> None:
        self.allowed, self._dir = allowed, directory
        self._regions: dict[str, _Region] = {}
        self._lock = threading.Lock()  # a descriptor is never closed while it is read or written

    def register(self, name: str, key: str, offset: int, byte_size: int) -> None:
        if not self.allowed:
            raise Forbidden(SHM_OFF)
        if not name or len(name) > _NAME_LIMIT:
            raise BadRequest(f"a region name has 1 to {_NAME_LIMIT} characters, got {len(name)}")
        m = _KEY.fullmatch(key)
        if m is None or m.group(1) in (".", ".."):
            raise BadRequest(
                f"invalid shared memory key {key[:80]!r}: one name of letters, digits and ._@:+-,"
                " optionally after a '/'"
            )
        _uint(offset, "'offset'")
        _uint(byte_size, "'byte_size'")
        self._not_registered(name)
        fd = self._open(m.group(1), key, offset + byte_size)
        with self._lock:
            if name in self._regions:  # registered by another request meanwhile
                os.close(fd)
                self._not_registered(name)
            self._regions[name] = _Region(name, key, offset, byte_size, fd)

    def _not_registered(self, name: str) -> None:
        if name in self._regions:
            raise BadRequest(f"shared memory region {name!r} is already registered")

    def _open(self, filename: str, key: str, end: int) -> int:
        """A descriptor of the object ``filename``, a regular file of at least ``end`` bytes."""
        try:
            fd = os.open(os.path.join(self._dir, filename), os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
        except FileNotFoundError:
            raise BadRequest(f"unable to open shared memory key {key!r}: it does not exist") from None
        except OSError as exc:
            raise BadRequest(f"unable to open shared memory key {key!r}: {exc.strerror}") from None
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size < end:
            os.close(fd)
            if not stat.S_ISREG(st.st_mode):
                raise BadRequest(f"shared memory key {key!r} is not a shared memory object")
            raise BadRequest(
                f"offset + byte_size ({end}) is past the end of shared memory key {key!r}"
                f" ({st.st_size} bytes)"
            )
        return fd

    def unregister(self, name: str | None = None) -> None:
        """Forget ``name`` (every region when None); an unknown name is not an error (Triton)."""
        if not self.allowed:
            raise Forbidden(SHM_OFF)
        with self._lock:
            gone = list(self._regions.values()) if name is None else [self._regions.get(name)]
            for region in gone:
                if region is not None:
                    del self._regions[region.name]
                    os.close(region.fd)

    def status(self, name: str | None = None) -> list[dict[str, Any]]:
        """``[{name, key, offset, byte_size}]`` of every region, or of ``name`` (404 if unknown)."""
        with self._lock:
            regions = sorted(self._regions.values(), key=lambda r: r.name)
            if name is not None:
                regions = [r for r in regions if r.name == name]
                if not regions:
                    raise NotFound(f"unable to find system shared memory region: {name!r}")
        return [{"name": r.name, "key": r.key, "offset": r.offset, "byte_size": r.byte_size} for r in regions]

    def check(self, ref: ShmRef, where: str) -> None:
        """``ref`` lies inside a registered region (else a 400 naming it)."""
        with self._lock:
            self._place(ref, where)

    def read(self, ref: ShmRef, where: str) -> bytes:
        """The ``ref.byte_size`` bytes at ``ref`` (a copy: the client may reuse the region)."""
        with self._lock:
            region = self._place(ref, where)
            data = os.pread(region.fd, ref.byte_size, region.offset + ref.offset)
        if len(data) != ref.byte_size:
            raise BadRequest(f"{where}: shared memory key {region.key!r} was shrunk after it was registered")
        return data

    def write(self, ref: ShmRef, data: bytes, where: str) -> None:
        """``data`` written at ``ref``, which must hold it."""
        if len(data) > ref.byte_size:
            raise BadRequest(
                f"{where}: shared memory size specified with the request ({ref.byte_size} bytes) should be"
                f" at least {len(data)} bytes to hold the results"
            )
        with self._lock:
            region = self._place(ref, where)
            written = os.pwrite(region.fd, data, region.offset + ref.offset)
        if written != len(data):
            raise BadRequest(
                f"{where}: only {written} of {len(data)} bytes could be written to shared memory"
            )

    def _place(self, ref: ShmRef, where: str) -> _Region:
        region = self._regions.get(ref.region)
        if region is None:
            hint = "" if self.allowed else f" ({SHM_OFF})"
            raise BadRequest(f"{where}: unable to find system shared memory region: {ref.region!r}{hint}")
        if ref.offset + ref.byte_size > region.byte_size:
            raise BadRequest(
                f"{where}: offset {ref.offset} + byte_size {ref.byte_size} is past the end of shared memory"
                f" region {ref.region!r} ({region.byte_size} bytes)"
            )
        return region

    def close(self) -> None:
        with self._lock:
            for region in self._regions.values():
                os.close(region.fd)
            self._regions.clear()


NO_REGIONS = SharedMemoryRegions(allowed=False)
"""The regions of a server without shared memory: none, and none may be registered."""
