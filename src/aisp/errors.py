"""The root of AISP's exception hierarchy.

    AispError
    ├── GraphError            the pipeline definition is invalid (raised at build time)
    ├── ConfigError           a config value is out of range or inconsistent
    ├── SourceError           a source cannot be opened or read
    ├── SinkError             a sink cannot be written
    ├── StateError            keyed state could not be stored
    ├── ModelError            a model cannot be loaded or its call failed
    │   ├── ModelTimeoutError a row waited past its timeout or deadline
    │   └── ModelNotFound     no such model or version in the repository (also a NotFound)
    └── RequestError          a request to a server cannot be served (as sent, or now)
        ├── BadRequest        malformed or invalid for its target (400)
        │   └── PayloadTooLarge   a body or line over its limit (413)
        ├── Forbidden         turned off on this server (403)
        ├── NotFound          no such model, version, pipeline or route (404)
        ├── Overloaded        refused by admission or a rate limit; retry later (429)
        ├── Unavailable       shutting down, or a worker it needs is restarting (503)
        └── DeadlineExceeded  its deadline passed before it was answered (504)

Each subpackage raises these (or subclasses of them); ``retriable`` tells retry and dead-letter
policy whether trying again can help, so callers never match on types for that. Every error
carries the status a server answers it with (``http_status``, and ``grpc_code``: the name of a
``grpc.StatusCode``), so transports never choose a status by reading a message: an error that
is not a ``RequestError`` is a fault of the server (500, INTERNAL).
"""

from __future__ import annotations

__all__ = [
    "AispError",
    "BadRequest",
    "ConfigError",
    "DeadlineExceeded",
    "Forbidden",
    "GraphError",
    "ModelError",
    "ModelNotFound",
    "ModelTimeoutError",
    "NotFound",
    "Overloaded",
    "PayloadTooLarge",
    "RequestError",
    "SinkError",
    "SourceError",
    "StateError",
    "Unavailable",
]


class AispError(Exception):
    """Base class of every error AISP raises on purpose."""

    retriable: bool = False
    http_status: int = 500
    grpc_code: str = "INTERNAL"


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


class RequestError(AispError):
    """A request cannot be served: the subclass says why and which status answers it."""

    http_status = 400
    grpc_code = "INVALID_ARGUMENT"


class BadRequest(RequestError):
    """The request is malformed or does not fit its target; the message names the field."""


class PayloadTooLarge(BadRequest):
    """A request body, message or line is larger than the server's limit (the message gives it)."""

    http_status = 413


class Forbidden(RequestError):
    """The operation is turned off on this server (model control without ``--allow-model-control``)."""

    http_status = 403
    grpc_code = "PERMISSION_DENIED"


class NotFound(RequestError):
    """No such model, model version, pipeline or route."""

    http_status = 404
    grpc_code = "NOT_FOUND"


class Overloaded(RequestError):
    """Refused by admission control or a rate limit; ``retry_after_s`` says when to try again."""

    retriable = True
    http_status = 429
    grpc_code = "RESOURCE_EXHAUSTED"

    def __init__(self, message: str, *, retry_after_s: float = 1.0) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class Unavailable(RequestError):
    """The server cannot take the request now (draining, or a worker it needs is restarting)."""

    retriable = True
    http_status = 503
    grpc_code = "UNAVAILABLE"


class DeadlineExceeded(RequestError):
    """The request's deadline (or timeout) passed before it was answered."""

    retriable = True
    http_status = 504
    grpc_code = "DEADLINE_EXCEEDED"


class ModelNotFound(ModelError, NotFound):
    """The repository has no such model, or no such version of it."""
