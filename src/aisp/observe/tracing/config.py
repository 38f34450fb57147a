"""What tracing is asked for (``TraceConfig``): the ``--trace-*`` options or the standard
OpenTelemetry variables. Kept apart from ``aisp.observe.tracing.spans`` so that deciding whether to
trace imports no OpenTelemetry: a run that does not trace never loads it."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from aisp.errors import ConfigError

__all__ = ["DEFAULT_ENDPOINT", "TraceConfig"]

DEFAULT_ENDPOINT = "http://127.0.0.1:4318/v1/traces"


@dataclass(frozen=True, kw_only=True)
class TraceConfig:
    """Tracing settings.

    Args:
        sample_ratio: share of events traced (0..1) when no ``traceparent`` decides.
        max_traces_per_s: at most this many new traces a second (0: no cap).
        endpoint: OTLP/HTTP traces endpoint; default ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``, or
            ``OTEL_EXPORTER_OTLP_ENDPOINT`` + ``/v1/traces``, or ``http://127.0.0.1:4318/v1/traces``.
        service_name: the ``service.name`` resource attribute.
    """

    sample_ratio: float = 0.01
    max_traces_per_s: float = 100.0
    endpoint: str | None = None
    service_name: str = "aisp"

    def __post_init__(self) -> None:
        if not 0.0 <= self.sample_ratio <= 1.0:
            raise ConfigError(f"sample_ratio must be in [0, 1], got {self.sample_ratio}")
        if self.max_traces_per_s < 0:
            raise ConfigError(f"max_traces_per_s must be >= 0, got {self.max_traces_per_s}")

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> TraceConfig | None:
        """Tracing as the standard OpenTelemetry variables ask for it: on when an OTLP endpoint
        is set (``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` or ``OTEL_EXPORTER_OTLP_ENDPOINT``) and
        ``OTEL_SDK_DISABLED`` is not true; the share from ``OTEL_TRACES_SAMPLER`` (``always_on``,
        the default, and ``parentbased_always_on``: 1; ``*always_off``: 0, so only clients' sampled
        traces; ``*traceidratio``: ``OTEL_TRACES_SAMPLER_ARG``); ``OTEL_SERVICE_NAME``. None: off.

        >>> env = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4318",
        ...        "OTEL_TRACES_SAMPLER": "traceidratio", "OTEL_TRACES_SAMPLER_ARG": "0.05"}
        >>> TraceConfig.from_env(env).sample_ratio
        0.05
        >>> TraceConfig.from_env({}) is None
        True
        """
        env = os.environ if environ is None else environ
        endpoint = env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or env.get("OTEL_EXPORTER_OTLP_ENDPOINT")
        if not endpoint or env.get("OTEL_SDK_DISABLED", "").lower() == "true":
            return None
        sampler = env.get("OTEL_TRACES_SAMPLER", "parentbased_always_on").lower()
        if sampler.endswith("always_off"):
            ratio = 0.0
        elif sampler.endswith("traceidratio"):
            try:
                ratio = float(env.get("OTEL_TRACES_SAMPLER_ARG", "1.0"))
            except ValueError:
                raise ConfigError(
                    f"OTEL_TRACES_SAMPLER_ARG must be a number, got {env['OTEL_TRACES_SAMPLER_ARG']!r}"
                ) from None
        else:
            ratio = 1.0
        return cls(sample_ratio=ratio, service_name=env.get("OTEL_SERVICE_NAME", "aisp"), endpoint=None)

    def resolved_endpoint(self) -> str:
        if self.endpoint:
            return self.endpoint
        if os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"):
            return os.environ["OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"]
        base = os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")
        return base.rstrip("/") + "/v1/traces" if base else DEFAULT_ENDPOINT
