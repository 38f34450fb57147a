"""Run code one step at a time for tests of state that readers see while it changes: a check
runs at every line the code executes, so a moment in which readers would see a half-made change
is found whenever it exists, not when another thread happens to look at that moment."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import Any, TypeVar

import aisp

T = TypeVar("T")
SRC = str(Path(aisp.__file__).parent)


def at_every_step(fn: Callable[[], T], check: Callable[[], None], *, files: tuple[str, ...] = ()) -> T:
    """``fn()``, calling ``check()`` at every call into and every line of AISP's code it runs in
    this thread (of the modules whose file names end with one of ``files``, when given), and once
    more at the end. ``check`` records what it finds: an exception inside a trace function would
    stop the tracing."""

    def watched(frame: FrameType) -> bool:
        name = frame.f_code.co_filename
        return name.startswith(SRC) and (not files or name.endswith(files))

    def local(frame: FrameType, event: str, arg: Any) -> Any:
        if event == "line":
            check()
        return local

    def enter(frame: FrameType, event: str, arg: Any) -> Any:
        if not watched(frame):
            return None
        check()
        return local

    previous = sys.gettrace()
    sys.settrace(enter)
    try:
        return fn()
    finally:
        sys.settrace(previous)
        check()
