"""A push demuxer for MPEG transport streams (ISO/IEC 13818-1): chunks in, complete PES packets out.

Why one of our own: FFmpeg's demuxers (PyAV's ``av.open``) pull from a file; a live stream comes
as pushed chunks of any size (broker messages, WebSocket frames, HTTP bodies), cut anywhere,
and what a stream's demuxer holds between two chunks must go into a checkpoint. This one's state
is plain bytes and numbers: the partial TS packet at the end of the last chunk, the programme
map, and each elementary stream's PES packet in progress (``state`` / ``from_state``).

``TsDemuxer.feed(chunk)`` reads the 188-byte packets the chunk completes: the programme
association and map tables (PAT, PMT: which PIDs carry which codec) and the PES packets of the
first video and first audio stream the map names. A PES packet is complete when its declared
length is in or, for the unbounded video PES that muxers write (length 0), when the next one of
its PID starts; ``finish()`` hands over those still open at the end of the stream. Damage is
reported, not raised: bytes that are not TS packets are skipped to the next sync byte, and a
PES packet with a gap in its continuity counter, a transport error flag or a header that does
not parse is dropped with the reason (``Pes`` of the others are exact). A PES packet larger than
``max_pes_bytes`` is dropped as it grows, so a stream that never starts a new one holds at most
that much.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["PACKET", "STREAM_TYPES", "Pes", "TsDemuxer"]

PACKET = 188
_SYNC = 0x47
STREAM_TYPES: dict[int, tuple[str, str]] = {
    0x01: ("video", "mpeg1video"),
    0x02: ("video", "mpeg2video"),
    0x10: ("video", "mpeg4"),
    0x1B: ("video", "h264"),
    0x24: ("video", "hevc"),
    0x03: ("audio", "mp3"),
    0x04: ("audio", "mp3"),
    0x0F: ("audio", "aac"),
    0x11: ("audio", "aac_latm"),
    0x81: ("audio", "ac3"),
    0x87: ("audio", "eac3"),
}
"""PMT stream types this demuxer hands on: (kind, FFmpeg decoder)."""
_PRIVATE = 0x06  # private data: codecs named by descriptors (Opus, AC-3 in DVB), not handed on


@dataclass(frozen=True, slots=True)
class Pes:
    """One PES packet of the video or audio stream: its FFmpeg decoder (as the programme map
    said when it ended), its payload (an access unit, or several audio frames), timestamps in
    90 kHz ticks (None: absent) and whether the TS packet that started it flagged a random
    access point."""

    kind: str
    codec: str
    pts: int | None
    dts: int | None
    payload: bytes
    random_access: bool


def _timestamp(b: bytes | bytearray, at: int) -> int:
    return (
        ((b[at] >> 1) & 0x07) << 30
        | b[at + 1] << 22
        | (b[at + 2] >> 1) << 15
        | b[at + 3] << 7
        | b[at + 4] >> 1
    )


class TsDemuxer:
    """One transport stream's demuxer (see the module docstring)."""

    def __init__(self, max_pes_bytes: int = 16 << 20) -> None:
        self.max_pes_bytes = max_pes_bytes
        self.tail = b""  # the last chunk's bytes after its last whole packet
        self.pmt_pid = -1
        self.pids: dict[int, str] = {}  # PID -> "video" / "audio" (the first of each the PMT names)
        self.codecs: dict[str, tuple[int, str]] = {}  # kind -> (stream type, decoder)
        self.unsupported: dict[str, int] = {}  # kind -> stream type this demuxer cannot hand on
        self._psi: dict[int, bytearray] = {}  # section in progress per PSI PID
        self._pes: dict[int, bytearray] = {}  # PES in progress per PID
        self._rai: dict[int, bool] = {}
        self._broken: dict[int, str] = {}  # PID -> why its PES in progress is to be dropped
        self._cc: dict[int, int] = {}
        self.packets = 0
        self.pmt_seen = False

    # -- checkpoints ------------------------------------------------------------------------------
    def state(self) -> tuple[dict[str, Any], bytes]:
        """(numbers and names, bytes): everything the demuxer holds, for a checkpoint."""
        blobs: list[bytes] = [self.tail]
        pes = []
        for pid, buf in self._pes.items():
            pes.append([pid, len(buf), self._rai.get(pid, False), self._broken.get(pid, "")])
            blobs.append(bytes(buf))
        psi = []
        for pid, buf in self._psi.items():
            psi.append([pid, len(buf)])
            blobs.append(bytes(buf))
        meta = {
            "tail": len(self.tail),
            "pmt_pid": self.pmt_pid,
            "pids": [[pid, kind] for pid, kind in self.pids.items()],
            "codecs": {k: list(v) for k, v in self.codecs.items()},
            "unsupported": self.unsupported,
            "cc": [[pid, cc] for pid, cc in self._cc.items()],
            "pes": pes,
            "psi": psi,
            "packets": self.packets,
            "pmt_seen": self.pmt_seen,
        }
        return meta, b"".join(blobs)

    @classmethod
    def from_state(cls, meta: dict[str, Any], blob: bytes, max_pes_bytes: int = 16 << 20) -> TsDemuxer:
        d = cls(max_pes_bytes)
        at = int(meta["tail"])
        d.tail = blob[:at]
        d.pmt_pid = int(meta["pmt_pid"])
        d.pids = {int(pid): str(kind) for pid, kind in meta["pids"]}
        d.codecs = {str(k): (int(v[0]), str(v[1])) for k, v in meta["codecs"].items()}
        d.unsupported = {str(k): int(v) for k, v in meta["unsupported"].items()}
        d._cc = {int(pid): int(cc) for pid, cc in meta["cc"]}
        for pid, size, rai, broken in meta["pes"]:
            d._pes[int(pid)] = bytearray(blob[at : at + size])
            d._rai[int(pid)] = bool(rai)
            if broken:
                d._broken[int(pid)] = str(broken)
            at += size
        for pid, size in meta["psi"]:
            d._psi[int(pid)] = bytearray(blob[at : at + size])
            at += size
        d.packets = int(meta["packets"])
        d.pmt_seen = bool(meta["pmt_seen"])
        return d

    # -- bytes in -----------------------------------------------------------------------------------
    def feed(self, chunk: bytes) -> tuple[list[Pes], list[str]]:
        """The PES packets ``chunk`` completes, in order, and what was wrong with it (empty:
        nothing)."""
        data = self.tail + chunk if self.tail else chunk
        out: list[Pes] = []
        errors: list[str] = []
        i, n = 0, len(data)
        skipped = 0
        while n - i >= PACKET:
            if data[i] != _SYNC or (n - i >= 2 * PACKET and data[i + PACKET] != _SYNC):
                # not at a packet: on to the next place where two packets start in a row (or
                # one, at the end of what we have)
                j = data.find(b"\x47", i + 1)
                while j != -1 and n - j >= 2 * PACKET and data[j + PACKET] != _SYNC:
                    j = data.find(b"\x47", j + 1)
                j = n if j == -1 else j
                skipped += j - i
                i = j
                continue
            self._packet(data, i, out, errors)
            i += PACKET
        if i < n and data[i] != _SYNC:  # what is left is not the start of a packet either
            j = data.find(b"\x47", i)
            j = n if j == -1 else j
            skipped += j - i
            i = j
        self.tail = bytes(data[i:])
        if skipped:
            errors.insert(0, f"not an MPEG transport stream: {skipped} bytes without TS sync")
        return out, errors

    def finish(self) -> tuple[list[Pes], list[str]]:
        """The PES packets still open at the end of the stream (and the reason for any dropped)."""
        out: list[Pes] = []
        errors: list[str] = []
        for pid in list(self._pes):
            self._complete(pid, out, errors)
        if self.tail:
            errors.append(f"truncated transport stream: {len(self.tail)} bytes of a last packet")
            self.tail = b""
        return out, errors

    def _packet(self, data: bytes, i: int, out: list[Pes], errors: list[str]) -> None:
        self.packets += 1
        b1, b2, b3 = data[i + 1], data[i + 2], data[i + 3]
        pid = (b1 & 0x1F) << 8 | b2
        start = bool(b1 & 0x40)
        control = (b3 >> 4) & 0x03
        cc = b3 & 0x0F
        if pid == 0x1FFF or control in (0, 2):  # null packet, or no payload (adaptation only)
            return
        at = i + 4
        rai = False
        if control == 3:
            length = data[at]
            if length > 183:
                self._break(pid, "corrupt TS packet: adaptation field longer than the packet")
                return
            if length:
                rai = bool(data[at + 1] & 0x40)
            at += 1 + length
        payload = data[at : i + PACKET]
        if b1 & 0x80:
            self._break(pid, "corrupt TS packet: transport error flag set")
            return
        last = self._cc.get(pid)
        self._cc[pid] = cc
        if last is not None and cc != (last + 1) & 0x0F:
            if cc == last:
                return  # a duplicate packet, allowed once
            self._break(pid, f"lost TS packets: continuity counter of PID {pid} jumped {last} -> {cc}")
        if pid == 0 or pid == self.pmt_pid:
            self._section(pid, start, payload)
            return
        kind = self.pids.get(pid)
        if kind is None:
            return
        if start:
            if pid in self._pes:
                self._complete(pid, out, errors)
            self._pes[pid] = bytearray(payload)
            self._rai[pid] = rai
        elif pid in self._pes:
            buf = self._pes[pid]
            if len(buf) + len(payload) > self.max_pes_bytes:
                errors.append(f"PES packet of the {kind} stream over {self.max_pes_bytes} bytes: dropped")
                del self._pes[pid]
                return
            buf += payload
        else:
            return  # the middle of a PES packet whose start we did not see
        buf = self._pes[pid]
        if len(buf) >= 6:
            declared = buf[4] << 8 | buf[5]
            if declared and len(buf) >= 6 + declared:
                self._complete(pid, out, errors)

    def _break(self, pid: int, why: str) -> None:
        if pid in self._pes:
            self._broken.setdefault(pid, why)

    def _complete(self, pid: int, out: list[Pes], errors: list[str]) -> None:
        buf = self._pes.pop(pid)
        rai = self._rai.pop(pid, False)
        broken = self._broken.pop(pid, None)
        kind = self.pids.get(pid, "?")
        if broken:
            errors.append(f"{broken}; a {kind} PES packet dropped")
            return
        if len(buf) < 9 or buf[0] != 0 or buf[1] != 0 or buf[2] != 1:
            errors.append(f"corrupt PES packet in the {kind} stream: no start code")
            return
        declared = buf[4] << 8 | buf[5]
        end = 6 + declared if declared else len(buf)
        if end > len(buf):
            errors.append(f"truncated PES packet in the {kind} stream: {len(buf)} of {end} bytes")
            return
        flags, header = buf[7], buf[8]
        body = 9 + header
        if body > end:
            errors.append(f"corrupt PES packet in the {kind} stream: header longer than the packet")
            return
        pts = dts = None
        if flags & 0x80:
            if header < 5:
                errors.append(f"corrupt PES packet in the {kind} stream: PTS flag without a PTS")
                return
            pts = _timestamp(buf, 9)
            if flags & 0x40 and header >= 10:
                dts = _timestamp(buf, 14)
        codec = self.codecs.get(kind, (0, ""))[1]
        if codec:
            out.append(Pes(kind, codec, pts, dts, bytes(buf[body:end]), rai))

    def _section(self, pid: int, start: bool, payload: bytes) -> None:
        """PAT and PMT sections, which may span packets."""
        if start:
            if not payload:
                return
            pointer = payload[0]
            self._psi[pid] = bytearray(payload[1 + pointer :])
        elif pid in self._psi:
            self._psi[pid] += payload
        else:
            return
        sec = self._psi[pid]
        if len(sec) < 3:
            return
        size = 3 + ((sec[1] & 0x0F) << 8 | sec[2])
        if len(sec) < size:
            if len(sec) > 4096:  # a section is at most 1024 bytes (4096 in private tables)
                del self._psi[pid]
            return
        del self._psi[pid]
        table = sec[:size]
        if pid == 0 and table[0] == 0x00:
            self._pat(table)
        elif pid == self.pmt_pid and table[0] == 0x02:
            self._pmt(table)

    def _pat(self, t: bytes | bytearray) -> None:
        for at in range(8, len(t) - 4 - 3, 4):
            program = t[at] << 8 | t[at + 1]
            if program != 0:  # 0 names the network information table
                self.pmt_pid = (t[at + 2] & 0x1F) << 8 | t[at + 3]
                return

    def _pmt(self, t: bytes | bytearray) -> None:
        if len(t) < 16:  # the fixed fields and the CRC: a shorter map is damaged
            return
        info = (t[10] & 0x0F) << 8 | t[11]
        at = 12 + info
        pids: dict[int, str] = {}
        codecs: dict[str, tuple[int, str]] = {}
        unsupported: dict[str, int] = {}
        while at + 5 <= len(t) - 4:
            kind_code = t[at]
            pid = (t[at + 1] & 0x1F) << 8 | t[at + 2]
            es_info = (t[at + 3] & 0x0F) << 8 | t[at + 4]
            at += 5 + es_info
            known = STREAM_TYPES.get(kind_code)
            if known is None:
                # the kind of an unknown type: video types are 0x01, 0x02, 0x10, 0x1B, 0x24 and
                # others in 0x20-0x2F and 0x42 (AVS), 0xD1 (Dirac), 0xEA (VC-1)
                kind = "video" if kind_code in (0x42, 0xD1, 0xEA) or 0x20 <= kind_code <= 0x2F else "audio"
                if kind_code != _PRIVATE and kind not in codecs:
                    unsupported.setdefault(kind, kind_code)
                continue
            kind, decoder = known
            if kind in codecs:
                continue
            codecs[kind] = (kind_code, decoder)
            pids[pid] = kind
        for pid in list(self._pes):
            if pid not in pids:
                self._pes.pop(pid)
        self.pids, self.codecs = pids, codecs
        self.pmt_seen = True
        self.unsupported = {k: v for k, v in unsupported.items() if k not in codecs}
