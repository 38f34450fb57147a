"""The ``aisp`` command: ``run`` or ``serve`` a pipeline file, ``bench`` and ``diagnose`` a running
one, ``chaos`` tests, print a ``topology``.

One module per group of commands (``pipelines``: run, topology; ``serve``; ``observe``: bench,
diagnose; ``chaos``), each registering its commands on the app; ``common`` holds the app and
what they share.
"""

from __future__ import annotations

from aisp.cli import chaos, observe, pipelines, serve  # noqa: F401 - the commands register on ``app``
from aisp.cli.common import app, load_pipeline, main

__all__ = ["app", "load_pipeline", "main"]
