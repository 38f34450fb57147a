"""Triton's statistics extension: per model version, requests, queueing and compute times."""

from __future__ import annotations

import threading
import time
from typing import Any

from aisp.observe.clock import wall_ms

__all__ = ["ModelStats"]


class ModelStats:
    """Triton's statistics extension for one model version, since it was loaded.

    Requests: ``success`` / ``fail`` (count, total ns from receipt to answer). Rows: ``queue``
    (each row counted with its batch's queueing time), ``compute_input`` / ``compute_infer`` /
    ``compute_output`` per model call, and the same per batch size in ``batch_stats``.
    """

    _PHASES = ("success", "fail", "queue", "compute_input", "compute_infer", "compute_output")

    def __init__(self, name: str, version: str) -> None:
        self.name, self.version = name, version
        self._lock = threading.Lock()
        self._phases = {p: [0, 0] for p in self._PHASES}
        self._batches: dict[int, list[int]] = {}  # size -> count, input ns, infer ns, output ns
        self.inference_count = 0
        self.execution_count = 0
        self.last_inference_ns = 0  # monotonic; reported as Unix ms
        self._input_ns = 0
        self._output_ns = 0

    def request(self, ok: bool, ns: int) -> None:
        self.requests(1, ns, ok=ok)

    def requests(self, count: int, ns: int, *, ok: bool = True) -> None:
        """``count`` requests, successful (or not) and answered in ``ns`` in all."""
        with self._lock:
            entry = self._phases["success" if ok else "fail"]
            entry[0] += count
            entry[1] += ns
            self.last_inference_ns = time.monotonic_ns()

    def batch(self, rows: int, wait_ns: int, input_ns: int, infer_ns: int, output_ns: int) -> None:
        with self._lock:
            self.inference_count += rows
            self.execution_count += 1
            for phase, ns in (
                ("queue", wait_ns * rows),
                ("compute_input", input_ns),
                ("compute_infer", infer_ns),
                ("compute_output", output_ns),
            ):
                entry = self._phases[phase]
                entry[0] += rows if phase == "queue" else 1
                entry[1] += ns
            b = self._batches.setdefault(rows, [0, 0, 0, 0])
            b[0] += 1
            b[1] += input_ns
            b[2] += infer_ns
            b[3] += output_ns

    def to_dict(self) -> dict[str, Any]:
        """The ``$model_stat`` object of the HTTP/REST statistics extension."""
        with self._lock:
            return {
                "name": self.name,
                "version": self.version,
                "last_inference": wall_ms(self.last_inference_ns) if self.last_inference_ns else 0,
                "inference_count": self.inference_count,
                "execution_count": self.execution_count,
                "inference_stats": {p: {"count": c, "ns": ns} for p, (c, ns) in self._phases.items()},
                "batch_stats": [
                    {
                        "batch_size": size,
                        "compute_input": {"count": n, "ns": i},
                        "compute_infer": {"count": n, "ns": c},
                        "compute_output": {"count": n, "ns": o},
                    }
                    for size, (n, i, c, o) in sorted(self._batches.items())
                ],
            }
