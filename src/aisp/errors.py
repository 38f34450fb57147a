"""The root of AISP's exception hierarchy.

    AispError
    ├── GraphError            the pipeline definition is invalid (raised at build time)
    ├── ConfigError           a config value is out of range or inconsistent
    ├── SourceError           a source cannot be opened or read
    ├── SinkError             a sink cannot be written
    ├── StateError            keyed state could not be stored
    └── ModelError            a model cannot be loaded or its call failed
        └── ModelTimeoutError a row waited past its timeout or deadline

Each subpackage raises these (or subclasses of them); ``retriable`` tells retry and dead-letter
policy whether trying again can help, so callers never match on types for that.
"""

from __future__ import annotations

__all__ = [
    "AispError",
    "ConfigError",
    "GraphError",
    "ModelError",
    "ModelTimeoutError",
    "SinkError",
    "SourceError",
    "StateError",
]


class AispError(Exception):
    """Base class of every error AISP raises on purpose."""

    retriable: bool = False


class GraphError(AispError):
    """The pipeline graph is invalid: a cycle, a dangling output, an unknown input or a duplicate id.

    Raised by ``Pipeline.build()``; ``step`` names the step at fault so the message can point at it.
    """

    def __init__(self, message: str, *, step: str | None = None) -> None:
        super().__init__(message)
        self.step = step


class ConfigError(AispError, ValueError):
    """A configuration value is invalid; the message gives the limit and the value received."""


class SourceError(AispError):
    """A source could not be opened or read."""


class SinkError(AispError):
    """A sink could not be opened or written."""


class StateError(AispError):
    """Keyed state could not be written to (or read from) its store."""


class ModelError(AispError):
    """A model could not be loaded, or a call to it failed."""


class ModelTimeoutError(ModelError):
    """A row waited in the batcher past its per-row timeout or its deadline."""

    retriable = True
