"""Resampling streams of audio chunks, each stream's filter carried from chunk to chunk.

``AudioDecode`` resamples each input on its own, which is right for whole files and wrong for a
stream cut into chunks: every chunk's edges would be filtered as if the signal stopped there. A
``Resample`` step is keyed by stream id (``stream.key_by("by_stream", "stream").apply("resample",
Resample(input_rate=48000))``) and filters each stream as one signal: a polyphase FIR filter at
the rational ratio ``up / down`` of the rates, the filter ``scipy.signal.resample_poly`` designs
(a Kaiser-windowed sinc, ``beta`` 5, ``10 * max(up, down)`` taps on each side of its centre),
run by ``scipy.signal.upfirdn`` (in C).
An output sample is made once every input it needs has come, so a stream lags its input by half
the filter (30 input samples from 48 kHz to 16 kHz, 0.6 ms); each stream's last inputs that no
output can use yet, and how many inputs and outputs it has seen, are keyed state: checkpointed
and restored as any other. So chunks of any sizes give, sample for sample, what
``resample_poly`` gives for the whole stream (up to the samples still waiting for their
neighbours).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from functools import cached_property

import numpy as np
import numpy.typing as npt
import pyarrow as pa

from aisp.batch import KEY, Batch
from aisp.errors import ConfigError
from aisp.transform.media.common import MediaCounters, samples_column
from aisp.transform.operators import Operator, OperatorContext
from aisp.transform.stateful import Stateful, StateView

__all__ = ["Resample", "polyphase_filter"]


def polyphase_filter(up: int, down: int) -> npt.NDArray[np.float64]:
    """The low-pass filter ``resample_poly`` uses for ``up / down`` (both already reduced):
    ``2 * 10 * max(up, down) + 1`` taps of a sinc cut at the lower Nyquist rate, Kaiser window
    (beta 5), unit gain at DC, times ``up``.

    >>> h = polyphase_filter(1, 3)
    >>> len(h), round(float(h.sum()), 6)
    (61, 1.0)
    """
    top = max(up, down)
    half = 10 * top
    m = np.arange(2 * half + 1) - half
    h: npt.NDArray[np.float64] = np.sinc(m / top) / top * np.kaiser(2 * half + 1, 5.0)
    h *= up / h.sum()
    return h


@dataclass(frozen=True, kw_only=True)
class Resample:
    """The keyed resampling step's settings (see the module docstring)."""

    input_rate: int
    sample_rate: int = 16000
    column: str = "samples"
    space: str = ""
    counters: MediaCounters = field(default_factory=lambda: MediaCounters("samples"), compare=False)

    def __post_init__(self) -> None:
        if self.input_rate < 1 or self.sample_rate < 1:
            raise ConfigError(f"rates must be > 0, got {self.input_rate} and {self.sample_rate}")

    @cached_property
    def _plan(self) -> tuple[int, int, int, npt.NDArray[np.float64]]:
        g = math.gcd(self.input_rate, self.sample_rate)
        up, down = self.sample_rate // g, self.input_rate // g
        return up, down, 10 * max(up, down), polyphase_filter(up, down)

    @property
    def held_width(self) -> int:
        """The most input samples a stream can be waiting on (its state's width)."""
        up, _, half, _ = self._plan
        return 2 * half // up + 2

    def state_columns(self) -> list[tuple[str, str, float]]:
        held = [(f"held_{j:04d}", "float32", 0.0) for j in range(self.held_width)]
        return [("inputs", "int64", 0), ("outputs", "int64", 0), ("held_len", "int32", 0), *held]

    def build(self, ctx: OperatorContext) -> Operator:
        return Stateful(self._update, self.space, tuple(self.state_columns())).build(ctx)

    def _first_input(self, m: int) -> int:
        """The first input index that output ``m`` reads (may be negative: zeros before the start)."""
        up, down, half, _ = self._plan
        return -((half - m * down) // up)

    def _outputs(self, start: int, buf: npt.NDArray[np.float32], base: int) -> npt.NDArray[np.float64]:
        """Outputs ``start`` on that every input they need is in ``buf`` (whose first sample is
        input ``base``) or before the stream's start (zeros), by ``scipy.signal.upfirdn``: its
        ``n``-th output reads ``buf[i]`` with tap ``n * down - i * up`` of a filter delayed by
        ``lead`` zeros, chosen so that output ``m`` of the stream is its ``m + shift``-th."""
        from scipy.signal import upfirdn

        up, down, half, h = self._plan
        end = (base + len(buf)) * up - half - 1  # the last output's m * down may be this
        count = end // down + 1 - start if end >= 0 else 0
        if count <= 0 or not len(buf):
            return np.zeros(0)
        lead = (base * up - half) % down
        shift = (half - base * up + lead) // down
        made: npt.NDArray[np.float64] = upfirdn(np.pad(h, (lead, 0)), buf.astype(np.float64), up, down)
        return made[start + shift : start + shift + count]

    def _update(self, batch: Batch, state: StateView) -> Batch:
        took = time.perf_counter_ns()
        col = batch.column(self.column)
        if not (pa.types.is_list(col.type) or pa.types.is_large_list(col.type)):
            raise ConfigError(f"column {self.column!r} is {col.type}, not a list of samples")
        up, down, _, _ = self._plan
        if up == down:
            return batch
        offsets = col.offsets.to_numpy()
        values = col.values.to_numpy(zero_copy_only=False).astype(np.float32, copy=False)
        codes = batch.numpy(KEY)
        width = self.held_width
        held_cols = [state.column(f"held_{j:04d}") for j in range(width)]
        held_len, seen, made = state.column("held_len"), state.column("inputs"), state.column("outputs")
        out: list[npt.NDArray[np.float64]] = [np.zeros(0)] * len(codes)
        for round_rows in state.rounds():
            keys = codes[round_rows]
            held = np.stack([c[keys] for c in held_cols], axis=1)
            new_held = np.zeros((len(keys), width), dtype=np.float32)
            for j, row in enumerate(round_rows.tolist()):
                key = keys[j]
                buf = np.concatenate([held[j, : held_len[key]], values[offsets[row] : offsets[row + 1]]])
                base = int(seen[key]) - int(held_len[key])
                out[row] = self._outputs(int(made[key]), buf, base)
                made[key] += len(out[row])
                seen[key] = base + len(buf)
                keep = buf[max(0, self._first_input(int(made[key])) - base) :]
                new_held[j, : len(keep)] = keep
                held_len[key] = len(keep)
            for i, c in enumerate(held_cols):
                c[keys] = new_held[:, i]
        samples, lengths = samples_column(out)
        self.counters.add(
            items=len(out),
            refused=0,
            nbytes=values.nbytes,
            decode_ns=time.perf_counter_ns() - took,
            units=int(lengths.sum()),
        )
        return batch.with_columns({self.column: samples})
