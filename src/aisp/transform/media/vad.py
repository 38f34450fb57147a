"""Speech segments per audio stream: Silero VAD, a recurrent model, run across every stream at once.

``SpeechSegments`` (keyed by stream id, after ``AudioDecode`` at 16 kHz: ``stream.key_by(...)
.apply("vad", SpeechSegments())``) gives each stream's samples to Silero VAD (ONNX, from the
``silero-vad`` package, installed ``--no-deps`` by ``make``: ``packaged_silero_vad()`` finds it
without importing the package, whose Python side needs torch) 512 samples (32 ms) at a time,
each window with the 64 samples before it, as the model was trained. The model is recurrent: its
state (2 x 128 floats) goes from one window of a stream to the next. A stateless model step
cannot carry that between calls, so this step runs the model itself, and batches it the way an
infer step would, across streams: the batch's rows are taken window by window, and the n-th
window of every row that has one goes into one model call, each row with its own stream's state.
A stream's recurrent state, its last 64 samples, the samples short of a window and where it is in
a segment are keyed state, checkpointed and restored like any other, so a restart goes on
mid-speech.

A segment starts at the first window whose speech probability reaches ``threshold`` and ends
where the probability has stayed below ``threshold - 0.15`` for ``min_silence_ms``; segments
shorter than ``min_speech_ms`` are dropped (Silero's own streaming rules). Each row gets the
segments that ended in its samples, ``speech_start`` and ``speech_end`` (seconds from the
stream's start, lists), ``speaking`` (whether a segment is open at the row's end),
``speech_open`` (the open segment's start, seconds; NaN when none is open) and ``speech_prob``
(each window's probability, a list). ``SpeechToText`` (``aisp.transform.media.speech``) reads
the segments off these columns.
"""

from __future__ import annotations

import importlib.util
import threading
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import numpy.typing as npt
import pyarrow as pa

from aisp.batch import KEY, Batch
from aisp.errors import ConfigError
from aisp.transform.operators import Operator, OperatorContext
from aisp.transform.stateful import Stateful, StateView

__all__ = ["SpeechSegments", "packaged_silero_vad"]

RATE = 16000
WINDOW = 512
CONTEXT = 64
_STATE = 2 * 128


def packaged_silero_vad() -> Path:
    """Silero VAD's ONNX file from the ``silero-vad`` package."""
    spec = importlib.util.find_spec("silero_vad")
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError("package 'silero_vad' is not installed: pip install --no-deps silero-vad")
    path = Path(next(iter(spec.submodule_search_locations))) / "data" / "silero_vad.onnx"
    if not path.is_file():
        raise ConfigError(f"{path} is missing from its package")
    return path


@dataclass(frozen=True, kw_only=True)
class SpeechSegments:
    """The voice activity step's settings (see the module docstring)."""

    column: str = "samples"
    model: str | None = None
    """An ONNX file with Silero VAD's inputs (``input``, ``state``, ``sr``); None: the packaged one."""
    threshold: float = 0.5
    min_silence_ms: float = 100.0
    min_speech_ms: float = 250.0
    threads: int = 1
    space: str = ""

    def __post_init__(self) -> None:
        if not 0.15 < self.threshold < 1:
            raise ConfigError(f"threshold must be in (0.15, 1), got {self.threshold}")

    def state_columns(self) -> list[tuple[str, str, float]]:
        pending = [(f"pend_{j:03d}", "float32", 0.0) for j in range(WINDOW - 1)]
        context = [(f"ctx_{j:02d}", "float32", 0.0) for j in range(CONTEXT)]
        rnn = [(f"rnn_{j:03d}", "float32", 0.0) for j in range(_STATE)]
        marks = [
            ("pending", "int32", 0),
            ("windows", "int64", 0),
            ("start", "int64", -1),
            ("quiet_from", "int64", -1),
        ]
        return [*marks, *pending, *context, *rnn]

    def build(self, ctx: OperatorContext) -> Operator:
        return Stateful(_Vad(self).update, self.space, tuple(self.state_columns())).build(ctx)


class _Vad:
    def __init__(self, spec: SpeechSegments) -> None:
        import onnxruntime as ort

        self.spec = spec
        opts = ort.SessionOptions()
        opts.intra_op_num_threads = spec.threads
        opts.inter_op_num_threads = 1
        path = spec.model or str(packaged_silero_vad())
        self._session = ort.InferenceSession(path, sess_options=opts, providers=["CPUExecutionProvider"])
        self._lock = threading.Lock()
        self._sr = np.array(RATE, dtype=np.int64)
        self.min_silence = int(spec.min_silence_ms * RATE / 1000)
        self.min_speech = int(spec.min_speech_ms * RATE / 1000)
        self._closed: dict[int, list[tuple[int, int]]] = {}  # segments ended this round, by key

    def update(self, batch: Batch, state: StateView) -> Batch:
        col = batch.column(self.spec.column)
        offsets = col.offsets.to_numpy()
        values = col.values.to_numpy(zero_copy_only=False).astype(np.float32, copy=False)
        codes = batch.numpy(KEY)
        rows = len(codes)
        pend_cols = [state.column(f"pend_{j:03d}") for j in range(WINDOW - 1)]
        ctx_cols = [state.column(f"ctx_{j:02d}") for j in range(CONTEXT)]
        rnn_cols = [state.column(f"rnn_{j:03d}") for j in range(_STATE)]
        pending, windows = state.column("pending"), state.column("windows")
        starts, quiet = state.column("start"), state.column("quiet_from")
        seg_start: list[list[float]] = [[] for _ in range(rows)]
        seg_end: list[list[float]] = [[] for _ in range(rows)]
        probs_out: list[list[float]] = [[] for _ in range(rows)]
        speaking = np.zeros(rows, dtype=bool)
        open_at = np.full(rows, np.nan)
        for round_rows in state.rounds():
            keys = codes[round_rows]
            held = np.stack([c[keys] for c in pend_cols], axis=1)
            bufs = []
            for j, row in enumerate(round_rows.tolist()):
                bufs.append(
                    np.concatenate([held[j, : pending[keys[j]]], values[offsets[row] : offsets[row + 1]]])
                )
            counts = np.array([len(b) // WINDOW for b in bufs], dtype=np.int64)
            context = np.stack([c[keys] for c in ctx_cols], axis=1)
            rnn = (
                np.stack([c[keys] for c in rnn_cols], axis=1)
                .reshape(len(keys), 2, 128)
                .transpose(1, 0, 2)
                .copy()
            )
            first_window = windows[keys].copy()
            for t in range(int(counts.max()) if len(counts) else 0):
                active = np.flatnonzero(counts > t)
                x = np.empty((len(active), CONTEXT + WINDOW), dtype=np.float32)
                for k, j in enumerate(active.tolist()):
                    x[k, CONTEXT:] = bufs[j][t * WINDOW : (t + 1) * WINDOW]
                x[:, :CONTEXT] = context[active]
                with self._lock:
                    prob, new_state = self._session.run(
                        None, {"input": x, "state": np.ascontiguousarray(rnn[:, active]), "sr": self._sr}
                    )
                rnn[:, active] = new_state
                context[active] = x[:, -CONTEXT:]
                self._segments(prob.reshape(-1), keys[active], first_window[active] + t, starts, quiet)
                for k, j in enumerate(active.tolist()):
                    row = int(round_rows[j])
                    probs_out[row].append(float(prob[k, 0]))
            rests = np.zeros((len(keys), WINDOW - 1), dtype=np.float32)
            for j, row in enumerate(round_rows.tolist()):
                key = keys[j]
                rest = bufs[j][counts[j] * WINDOW :]
                rests[j, : len(rest)] = rest
                pending[key] = len(rest)
                windows[key] += counts[j]
                speaking[row] = starts[key] >= 0
                if speaking[row]:
                    open_at[row] = starts[key] / RATE
                for start, end in self._closed.pop(int(key), []):
                    seg_start[row].append(start / RATE)
                    seg_end[row].append(end / RATE)
            for i, c in enumerate(pend_cols):
                c[keys] = rests[:, i]
            flat_rnn = rnn.transpose(1, 0, 2).reshape(len(keys), _STATE)
            for i, c in enumerate(rnn_cols):
                c[keys] = flat_rnn[:, i]
            for i, c in enumerate(ctx_cols):
                c[keys] = context[:, i]
        floats = pa.list_(pa.float64())
        return batch.with_columns(
            {
                "speech_start": pa.array(seg_start, floats),
                "speech_end": pa.array(seg_end, floats),
                "speaking": speaking,
                "speech_open": open_at,
                "speech_prob": pa.array(probs_out, floats),
            }
        )

    def _segments(
        self,
        prob: npt.NDArray[np.float32],
        keys: npt.NDArray[np.int64],
        window: npt.NDArray[np.int64],
        starts: npt.NDArray[np.int64],
        quiet: npt.NDArray[np.int64],
    ) -> None:
        """Silero's streaming rules for one window of each of ``keys`` (window indexes ``window``)."""
        begin, end = window * WINDOW, (window + 1) * WINDOW
        loud = prob >= self.spec.threshold
        hush = prob < self.spec.threshold - 0.15
        open_ = starts[keys] >= 0
        opening = loud & ~open_
        starts[keys[opening]] = begin[opening]
        quiet[keys[loud]] = -1
        falling = hush & open_
        fresh = falling & (quiet[keys] < 0)
        quiet[keys[fresh]] = end[fresh]
        closing = falling & (end - quiet[keys] >= self.min_silence)
        for key in keys[closing].tolist():
            s, e = int(starts[key]), int(quiet[key])
            if e - s >= self.min_speech:
                self._closed.setdefault(key, []).append((s, e))
            starts[key], quiet[key] = -1, -1
