"""The live progress view of a run (rich): events/s, e2e p50/p99, queue depth per stage."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import TracebackType
from typing import Any

from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

from aisp.graph import Graph
from aisp.observe.view import PipelineView

__all__ = ["LiveView", "merged_live_view"]


class LiveView:
    """Redraws a small table a few times a second while the executor runs."""

    def __init__(self, ex: PipelineView, console: Console | None = None) -> None:
        self._ex = ex
        self._live = Live(console=console or Console(stderr=True), refresh_per_second=4, transient=False)
        self._last_in = 0
        self._last_t = time.monotonic()
        self._rate = 0.0

    def __enter__(self) -> LiveView:
        self._live.__enter__()
        return self

    def __exit__(
        self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.update()
        self._live.__exit__(et, ev, tb)

    def update(self) -> None:
        self._live.update(self.render())

    def render(self) -> Group:
        st = self._ex.stats
        now = time.monotonic()
        dt = now - self._last_t
        if dt >= 0.2:
            self._rate = (st.events_in - self._last_in) / dt
            self._last_in, self._last_t = st.events_in, now
        lat = st.e2e.summary_ms()
        head = Text.assemble(
            (f"{self._ex.graph.name}", "bold"),
            f"  in {st.events_in:,}  out {st.events_out:,}  dead letters {self._ex.dead_letter.count:,}",
            f"  {self._rate:,.0f} events/s",
            f"  e2e p50 {lat['p50']:.2f} ms  p99 {lat['p99']:.2f} ms",
            f"  {st.seconds():.1f} s",
            ("  (draining)" if self._ex.stopping else ""),
        )
        table = Table(box=None, padding=(0, 2))
        for col in ("stage", "kind", "rows in", "rows out", "queue rows", "busy s"):
            table.add_column(col, justify="left" if col in ("stage", "kind") else "right")
        for s in st.stages.values():
            table.add_row(
                s.step_id,
                s.kind,
                f"{s.rows_in:,}",
                f"{s.rows_out:,}",
                f"{s.queue_rows():,}",
                f"{s.busy_ns / 1e9:.2f}",
            )
        return Group(head, table)


@contextmanager
def merged_live_view(
    graph: Graph, merged: Callable[[], dict[str, Any] | None]
) -> Iterator[Callable[[], None]]:
    """The live view of a run on several workers, from their merged snapshots; yields the tick
    that redraws it (at most 4 times a second)."""
    from aisp.observe.remote import SnapshotView

    view = SnapshotView(graph)
    last = 0.0

    def tick() -> None:
        nonlocal last
        if time.monotonic() - last < 0.25:
            return
        last = time.monotonic()
        data = merged()
        if data is not None:
            view.load(data)
            live.update()

    with LiveView(view) as live:
        yield tick
