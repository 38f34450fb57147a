"""JSON lines to rows and packed columns with nothing but the standard library and msgspec.

This module imports no other part of the engine (nor numpy or pyarrow), so that a fresh child
interpreter can run it alone: ``connectors/file/spawned.py`` reads and decodes a JSON-lines file
in such a child, about 20 MB of memory, where a forked child carries a copy of the pipeline
process's page tables and libraries (70 MB summed into the process tree's RSS). The engine uses
the same pieces in its own process (``ingest/decode.py``, ``connectors/file/source.py``), so the
two paths decode alike:

* ``decode_rows``: lines to msgspec objects, one C call per line, falling back per line with a
  reason for each line that does not decode, and per row for rows that do not convert;
* ``LineReader``: a file read in blocks into lines, with line numbers and byte offsets (the
  position), the UTF-8 byte order mark skipped, over-long lines skipped without being held;
* ``PlainSchema``: a ``msgspec.Struct`` of plain fields (numbers, booleans, strings, lists of
  numbers) described as JSON, rebuilt in the child, and its rows packed as column buffers
  (little-endian int64/float64, one byte per bool, int32 offsets + UTF-8 for strings).
"""

from __future__ import annotations

import fcntl
import struct
import termios
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import accumulate, chain
from operator import attrgetter
from typing import Annotated, Any, BinaryIO

import msgspec

__all__ = ["DecodeError", "LineReader", "PlainSchema", "decode_chunk", "decode_rows", "short"]

DECODE_ERRORS = (msgspec.DecodeError, msgspec.ValidationError, RecursionError)
BOM = b"\xef\xbb\xbf"
RAW_PREFIX = 1024  # bytes of an over-long line kept for its dead letter


@dataclass(frozen=True)
class DecodeError:
    """One line that did not decode: its index within the chunk and why."""

    index: int
    reason: str


def short(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def decode_rows(
    decoder: msgspec.json.Decoder[Any],
    lines: Sequence[bytes],
    build: Callable[[list[Any]], Any],
    row_error: Callable[[Any], str | None],
    convert_errors: tuple[type[BaseException], ...],
) -> tuple[Any, list[int] | None, list[DecodeError]]:
    """``build``'s columns of the valid lines, their indices (None: all) and the errors.

    ``build(items)`` makes the columns and may raise ``convert_errors`` for a value that does
    not fit its column; the rows are then built one by one and ``row_error(item)`` says why a
    row does not fit."""
    try:
        items = list(map(decoder.decode, lines))
        kept: list[int] | None = None
        errors: list[DecodeError] = []
    except DECODE_ERRORS:
        items, kept, errors = [], [], []
        for i, line in enumerate(lines):
            if not line.strip():
                errors.append(DecodeError(i, "empty line"))
                continue
            try:
                items.append(decoder.decode(line))
                kept.append(i)
            except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                errors.append(DecodeError(i, str(exc)))
            except RecursionError:
                errors.append(DecodeError(i, "JSON is nested too deeply"))
    try:
        return build(items), kept, errors
    except convert_errors:
        pass
    good: list[Any] = []
    good_index: list[int] = []
    for i, item in zip(range(len(items)) if kept is None else kept, items, strict=True):
        reason = row_error(item)
        if reason is None:
            good.append(item)
            good_index.append(i)
        else:
            errors.append(DecodeError(i, reason))
    errors.sort(key=lambda e: e.index)
    return build(good), good_index, errors


class TooLong(bytes):
    """The first bytes of a line longer than the limit; ``length`` is its full length."""

    length: int


class LineReader:
    """Lines of a JSON-lines file from a position ``{"offset", "line"}`` (and ``"end"``: stop
    at that byte offset), read in blocks of ``block_bytes``. A line longer than
    ``max_line_bytes`` comes as a ``TooLong`` marker holding its first bytes."""

    def __init__(self, fh: BinaryIO, position: Any, block_bytes: int, max_line_bytes: int) -> None:
        self._fh, self._block_bytes, self._max = fh, block_bytes, max_line_bytes
        self.offset, self.line = 0, 0
        self._end: int | None = None
        if position:
            self._end = position.get("end")
            self.offset, self.line = int(position["offset"]), int(position["line"])
            fh.seek(self.offset)
        elif fh.read(len(BOM)) == BOM:
            self.offset = len(BOM)
        else:
            fh.seek(0)
        self._lines: list[bytes] = []
        self._next = 0
        self._tail: list[bytes] = []  # the unfinished last line, in pieces
        self._tail_bytes = 0
        self._too_long = 0  # buffered ``TooLong`` lines
        self._eof = False

    @property
    def position(self) -> dict[str, int]:
        return {"offset": self.offset, "line": self.line}

    def take(self, max_lines: int) -> tuple[int, list[bytes], dict[int, int]] | None:
        """Up to ``max_lines`` lines: the first one's number, the lines (an over-long one as
        ``b""``) and ``{index: length}`` of the over-long ones; None at the end."""
        self._fill(max_lines)
        start = self._next
        n = min(max_lines, len(self._lines) - start)
        if n <= 0:
            return None
        lines = self._lines[start : start + n]
        self._next = start + n
        first = self.line + 1
        self.line += n
        too_long: dict[int, int] = {}
        if self._too_long:
            too_long = {i: x.length for i, x in enumerate(lines) if type(x) is TooLong}
            self._too_long -= len(too_long)
        self.offset += sum(map(len, lines)) + n + sum(v - len(lines[i]) for i, v in too_long.items())
        return first, lines, too_long

    def _fill(self, want: int) -> None:
        while len(self._lines) - self._next < want and not self._eof:
            size = (
                self._block_bytes
                if self._end is None
                else min(self._block_bytes, self._end - self._fh.tell())
            )
            block = self._fh.read(size) if size > 0 else b""
            rest = self._lines[self._next :]
            self._next = 0
            if not block:
                self._eof = True
                self._lines = [*rest, self._end_tail(b"")] if self._tail_bytes else rest
                break
            parts = block.split(b"\n")
            last = parts.pop()
            if parts:
                parts[0] = self._end_tail(parts[0])
                if len(block) > self._max:
                    parts[1:] = [self._checked(p) for p in parts[1:]]
            self._add_tail(last)
            self._lines = rest + parts if rest else parts

    def _add_tail(self, piece: bytes) -> None:
        if not piece:
            return
        if self._tail_bytes <= self._max:
            self._tail.append(piece)
            if self._tail_bytes + len(piece) > self._max:  # keep a prefix only
                self._tail = [b"".join(self._tail)[:RAW_PREFIX]]
        self._tail_bytes += len(piece)

    def _end_tail(self, piece: bytes) -> bytes:
        if not self._tail_bytes:
            return self._checked(piece)
        self._add_tail(piece)
        line = self._checked(b"".join(self._tail), self._tail_bytes)
        self._tail, self._tail_bytes = [], 0
        return line

    def _checked(self, line: bytes, length: int | None = None) -> bytes:
        length = len(line) if length is None else length
        if length <= self._max:
            return line
        marker = TooLong(line[:RAW_PREFIX])
        marker.length = length
        self._too_long += 1
        return marker


def decode_chunk(
    decode: Callable[[list[bytes]], tuple[Any, Any, list[DecodeError]]],
    chunk: tuple[int, list[bytes], dict[int, int]],
    step: str,
    limit: int,
) -> tuple[Any, Any, list[dict[str, Any]]]:
    """A ``LineReader.take`` chunk through ``decode`` (lines -> columns, kept, errors): its
    columns, the indices kept and the dead letters (an over-long line's says so)."""
    first, lines, too_long = chunk
    todo = [b"" if i in too_long else x for i, x in enumerate(lines)] if too_long else lines
    columns, kept, errors = decode(todo)
    return columns, kept, _dead_letters(step, first, lines, too_long, errors, limit) if errors else []


def _dead_letters(
    step: str, first: int, lines: list[bytes], too_long: dict[int, int], errors: list[DecodeError], limit: int
) -> list[dict[str, Any]]:
    """The dead letters of a chunk's ``errors`` (line numbers from ``first``)."""
    return [
        {
            "line": first + e.index,
            "step": step,
            "reason": e.reason
            if e.index not in too_long
            else f"line of {too_long[e.index]} bytes is longer than max_line_bytes ({limit}); skipped",
            "raw": lines[e.index].decode("utf-8", "replace"),
        }
        for e in errors
    ]


_NUMBER_RULES = ("ge", "gt", "le", "lt", "multiple_of")
_KINDS = {"int": int, "float": float, "bool": bool, "str": str}
_PACK = {"int": "q", "float": "d"}


def _plain_type(t: Any) -> dict[str, Any] | None:
    """A field type as JSON: ``{"kind", "rules", "item"?}``; None if not plain."""
    import msgspec.inspect as mi

    names: dict[type, str] = {
        mi.IntType: "int",
        mi.FloatType: "float",
        mi.BoolType: "bool",
        mi.StrType: "str",
    }
    kind = names.get(type(t))
    if kind is not None:
        rules = {r: getattr(t, r, None) for r in (*_NUMBER_RULES, "min_length", "max_length", "pattern")}
        return {"kind": kind, "rules": {k: v for k, v in rules.items() if v is not None}}
    if isinstance(t, mi.ListType) and isinstance(t.item_type, mi.IntType | mi.FloatType):
        item = _plain_type(t.item_type)
        rules = {"min_length": t.min_length, "max_length": t.max_length}
        return {"kind": "list", "item": item, "rules": {k: v for k, v in rules.items() if v is not None}}
    return None


def _annotation(desc: dict[str, Any]) -> Any:
    base = list[_annotation(desc["item"])] if desc["kind"] == "list" else _KINDS[desc["kind"]]  # type: ignore[misc]
    return Annotated[base, msgspec.Meta(**desc["rules"])] if desc["rules"] else base


class PlainSchema:
    """A struct schema of plain fields, as JSON (``describe``) and back (``struct``), and the
    packing of its rows into column buffers (``pack``)."""

    def __init__(self, desc: dict[str, Any]) -> None:
        self.desc = desc
        self.fields: list[dict[str, Any]] = desc["fields"]
        self.names = [f["name"] for f in self.fields]
        self._getters = [attrgetter(n) for n in self.names]

    @classmethod
    def describe(cls, schema: type[msgspec.Struct]) -> PlainSchema | None:
        """``schema`` as a ``PlainSchema``; None if a field is not plain (a union, a nested
        struct, a list of strings ...) or the struct is array-like or tagged."""
        import msgspec.inspect as mi

        info = mi.type_info(schema)
        if not isinstance(info, mi.StructType) or info.array_like or info.tag is not None:
            return None
        fields = []
        for f in info.fields:
            t = _plain_type(f.type)
            if t is None or not f.required:
                return None
            fields.append({"name": f.name, "key": f.encode_name, **t})
        return cls({"name": schema.__name__, "fields": fields, "forbid": info.forbid_unknown_fields})

    def struct(self) -> type[msgspec.Struct]:
        """A struct that decodes (and refuses) the same JSON as the described one."""
        return msgspec.defstruct(
            self.desc["name"],
            [(f["name"], _annotation(f)) for f in self.fields],
            rename={f["name"]: f["key"] for f in self.fields},
            forbid_unknown_fields=self.desc["forbid"],
            gc=False,  # plain fields hold no references to other objects: no cycles to track
        )

    def pack(self, items: list[Any]) -> list[bytes]:
        """The column buffers of ``items`` (two per string or list column: offsets, values);
        ``struct.error`` for an int beyond int64."""
        out: list[bytes] = []
        n = len(items)
        for f, get in zip(self.fields, self._getters, strict=True):
            values = list(map(get, items))
            kind = f["kind"]
            if kind in _PACK:
                out.append(struct.pack(f"<{n}{_PACK[kind]}", *values))
            elif kind == "bool":
                out.append(bytes(values))
            elif kind == "str":
                joined = "".join(values)
                data = joined.encode()
                sizes = map(len, values) if joined.isascii() else (len(v.encode()) for v in values)
                out.append(struct.pack(f"<{n + 1}i", 0, *accumulate(sizes)))
                out.append(data)
            else:  # a list of numbers
                code = _PACK[f["item"]["kind"]]
                out.append(struct.pack(f"<{n + 1}i", 0, *accumulate(map(len, values))))
                flat = list(chain.from_iterable(values))
                out.append(struct.pack(f"<{len(flat)}{code}", *flat))
        return out

    def row_error(self, item: Any) -> str | None:
        """Why ``item`` does not pack (an int beyond int64), in ``ColumnarDecoder``'s words."""
        for f, get in zip(self.fields, self._getters, strict=True):
            value = get(item)
            kind = f["kind"] if f["kind"] != "list" else f["item"]["kind"]
            if kind == "int":
                for v in value if f["kind"] == "list" else (value,):
                    if not -(2**63) <= v < 2**63:
                        return (
                            f"field `{f['name']}`: a number is out of range for its column ({short(value)})"
                        )
        return None


def aligned(parts: list[bytes]) -> list[bytes]:
    """``parts`` each padded to a multiple of 8 bytes, after a 1-byte tag (``MESSAGE_START``):
    every column buffer of a message then starts 8-byte aligned."""
    out = []
    at = 1
    for part in parts:
        out.append(part)
        at += len(part)
        if at % 8:
            out.append(bytes(8 - at % 8))
            at += 8 - at % 8
    return out


class BatchSizer:
    """How many lines the next batch takes: ``rows`` while the reader of the pipe ``fd`` keeps
    up; twice as many (up to ``most``) each time the batch sent before is still unread (the
    reader fell behind: larger batches cost it less per event), half as many again each time it
    finds the pipe empty (the reader waits: smaller batches reach it sooner)."""

    def __init__(self, fd: int, rows: int, most: int) -> None:
        self._fd, self._least, self._most, self.rows = fd, rows, max(rows, most), rows
        self._last = 0  # the size of the batch sent last, in bytes
        try:
            fcntl.fcntl(fd, 1032)  # F_GETPIPE_SZ: is it a pipe?
        except OSError:  # not a pipe: a fixed size
            self._most = rows

    def sent(self, nbytes: int) -> None:
        self._last = nbytes

    def next(self) -> int:
        if self._most > self._least and self._last:
            unread = self._unread()
            if unread >= self._last:
                self.rows = min(self.rows * 2, self._most)
            elif not unread:
                self.rows = max(self.rows // 2, self._least)
        return self.rows

    def _unread(self) -> int:
        try:
            buf = fcntl.ioctl(self._fd, termios.FIONREAD, b"\0\0\0\0")
        except OSError:
            return 0
        return int.from_bytes(buf, "little")


def child_main(argv: list[str]) -> None:
    """A child interpreter's reader (``connectors/file/spawned.py``): argv[0] is a JSON config,
    argv[1] the file descriptor to write messages to (a 4-byte little-endian length, then the
    message; first byte ``B`` a batch, ``D`` dead letters, ``E`` the end, ``X`` an error)."""
    import contextlib
    import gc
    import os
    import signal
    import time

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent drains on Ctrl-C, then closes
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    gc.set_threshold(100_000, 50, 100)
    cfg = msgspec.json.decode(argv[0])
    fd = int(argv[1])
    enc = msgspec.json.Encoder()

    def send(*parts: bytes) -> None:
        data = memoryview(struct.pack("<I", sum(map(len, parts))) + b"".join(parts))
        while data:
            data = data[os.write(fd, data) :]

    schema = PlainSchema(cfg["schema"])
    decoder = msgspec.json.Decoder(schema.struct())

    def decode(lines: list[bytes]) -> tuple[list[bytes], list[int] | None, list[DecodeError]]:
        return decode_rows(decoder, lines, schema.pack, schema.row_error, (struct.error,))

    limit = cfg["max_line_bytes"]
    sizer = BatchSizer(fd, cfg["batch_rows"], cfg.get("max_batch_rows", cfg["batch_rows"]))
    try:
        with open(cfg["path"], "rb") as fh:
            reader = LineReader(fh, cfg["position"], cfg["block_bytes"], limit)
            while (chunk := reader.take(sizer.next())) is not None:
                first, lines = chunk[0], chunk[1]
                now = time.monotonic_ns()
                columns, kept, records = decode_chunk(decode, chunk, cfg["step"], limit)
                if records:
                    send(b"D", enc.encode(records))
                ids = b"" if kept is None else struct.pack(f"<{len(kept)}q", *(first + i for i in kept))
                parts = [ids, *columns]
                rows = len(lines) if kept is None else len(kept)
                sizes = list(map(len, parts))
                header = enc.encode(
                    {"position": reader.position, "first": first, "rows": rows, "ns": now, "sizes": sizes}
                )
                message = aligned([struct.pack("<I", len(header)) + header, *parts])
                send(b"B", *message)
                sizer.sent(sum(map(len, message)))
            send(b"E")
    except (BrokenPipeError, ConnectionResetError):
        return  # the parent stopped reading: a stop, not an error
    except Exception as exc:  # noqa: BLE001 - reported to the parent, which raises it
        with contextlib.suppress(OSError):
            send(b"X", f"{type(exc).__name__}: {exc}".encode())
