"""What the ``aisp`` command's modules share: the app, the pipeline loader and option types."""

from __future__ import annotations

import importlib.util
import sys
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.console import Console

from aisp.errors import ConfigError
from aisp.pipeline import Pipeline

if TYPE_CHECKING:
    from aisp.serve.auth import Tokens

__all__ = ["app", "check_model_control", "err", "load_pipeline", "main"]

app = typer.Typer(add_completion=False, no_args_is_help=True, help="AISP: AI-native stream processing.")
err = Console(stderr=True)


def _reloader(target: str, params: dict[str, Any]) -> Any:
    """Loads the served pipeline file again (or another): a served pipeline's topology update."""

    def reload(path: str | None = None) -> Any:
        try:
            return load_pipeline(path or target, **params)
        except typer.BadParameter as exc:
            raise ConfigError(str(exc)) from exc

    return reload


def load_pipeline(path: str, **params: Any) -> Pipeline:
    """Import a pipeline file and return its pipeline.

    The file defines ``build(**params) -> Pipeline`` (preferred; it receives options such as
    ``events`` and ``schema``-dependent ``input``) or a module-level ``pipeline``.
    """
    file = Path(path)
    if not file.is_file():
        raise typer.BadParameter(f"no pipeline file at {path!r}")
    spec = importlib.util.spec_from_file_location(f"aisp_user_{file.stem}", file)
    if spec is None or spec.loader is None:
        raise typer.BadParameter(f"cannot import {path!r}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop(spec.name, None)  # no half-run module left behind
        raise
    build = getattr(module, "build", None)
    p = build(**params) if callable(build) else getattr(module, "pipeline", None)
    if not isinstance(p, Pipeline):
        raise typer.BadParameter(f"{path!r} defines neither build() -> Pipeline nor a `pipeline` object")
    return p


def check_model_control(host: str, allow_model_control: bool, tokens: Tokens) -> None:
    """``--allow-model-control`` loads models and runs pipeline files at a client's request: on an
    address other machines reach, only admin tokens may ask (``ConfigError`` otherwise)."""
    from aisp.serve.auth import is_loopback

    if allow_model_control and not tokens.admin and not is_loopback(host):
        raise ConfigError(
            f"--allow-model-control on {host} (not a loopback address) needs admin tokens: set"
            " AISP_ADMIN_TOKENS or [auth] admin_tokens in --config, or bind 127.0.0.1"
        )


TraceSample = Annotated[
    float, typer.Option(help="Trace this share of the events (OpenTelemetry over OTLP/HTTP; 0: off).")
]
TraceEndpoint = Annotated[
    str | None, typer.Option(help="OTLP/HTTP traces endpoint (default: OTEL_EXPORTER_OTLP_* or :4318).")
]
TraceMaxPerS = Annotated[float, typer.Option(help="At most this many new traces a second (0: no cap).")]


def _trace_config(sample: float, endpoint: str | None, max_per_s: float) -> Any:
    """``--trace-*`` options as a ``TraceConfig`` (None: tracing off). With an endpoint and no
    sample, only events whose client sent a sampled ``traceparent`` are traced. Without either,
    the standard ``OTEL_*`` variables decide (``TraceConfig.from_env``)."""
    from aisp.observe.tracing.config import TraceConfig

    if sample <= 0 and endpoint is None:
        from_env = TraceConfig.from_env()
        return None if from_env is None else replace(from_env, max_traces_per_s=max_per_s)
    return TraceConfig(sample_ratio=sample, endpoint=endpoint, max_traces_per_s=max_per_s)


def _params(pairs: list[str] | None) -> dict[str, Any]:
    """``--param KEY=VALUE`` pairs for ``build()`` (values stay strings)."""
    out: dict[str, Any] = {}
    for pair in pairs or []:
        key, sep, value = pair.partition("=")
        if not sep or not key.isidentifier():
            raise typer.BadParameter(f"--param takes KEY=VALUE, got {pair!r}")
        out[key] = value
    return out


def _bind(p: Pipeline, input: str | None, output: str | None) -> None:  # noqa: A002
    from aisp.connectors import sink_for, source_for

    if input is not None:
        p.bind(source=source_for(p, input))
    if output is not None:
        p.bind(sink=sink_for(p, output))


def main() -> None:
    import faulthandler
    import signal

    if hasattr(signal, "SIGUSR1"):  # `kill -USR1 PID`: every thread's stack to stderr (a hang)
        faulthandler.register(signal.SIGUSR1, all_threads=True)
    app()


def _limits(config: str | None) -> Any:
    """``[limits]`` of the TOML config (rows/s per API key and per tier), or None."""
    import tomllib

    from aisp.admission.ratelimit import RateLimits
    from aisp.admission.tiers import DEFAULT_TIERS

    if config is None:
        return None
    section = tomllib.loads(Path(config).read_text()).get("limits")
    return RateLimits.from_config(section, DEFAULT_TIERS) if section else None


def _tables(config: str | None, section: str) -> dict[str, Any]:
    """``[SECTION.NAME]`` tables of the TOML config: a served pipeline's anomaly policy
    (``anomaly``), a model's rollout policy (``rollout``)."""
    import tomllib

    if config is None:
        return {}
    tables = tomllib.loads(Path(config).read_text()).get(section, {})
    if not isinstance(tables, dict) or not all(isinstance(v, dict) for v in tables.values()):
        raise ConfigError(f"[{section}]: give one table per name, [{section}.NAME]")
    return tables


def _checkpoints(
    directory: str | None,
    interval_s: float,
    state_store: bool,
    state_max_keys: int,
    partition_state: str | None,
    standby_replicas: int = 0,
    from_savepoint: str | None = None,
    allow_model_change: bool = False,
) -> Any:
    """The checkpoint options of ``aisp run`` (None: no checkpoints), refusing state options that
    need a checkpoint directory without one."""
    from aisp.runner import CheckpointOptions
    from aisp.schedule.checkpointing.coordinator import CHANGELOG

    if directory is None:
        if state_store or state_max_keys:
            raise ConfigError("a state store needs --checkpoint-dir (it lives there)")
        if partition_state is not None:
            raise ConfigError("state that follows partitions is checkpointed: it needs --checkpoint-dir too")
        if from_savepoint is not None:
            raise ConfigError("--from-savepoint starts a run that checkpoints: it needs --checkpoint-dir too")
        if allow_model_change:
            raise ConfigError("--allow-model-change applies to a restore: it needs --checkpoint-dir")
        return None
    if standby_replicas and partition_state != CHANGELOG:
        raise ConfigError("standby replicas tail changelog topics: they need --partition-state changelog")
    if standby_replicas < 0:
        raise ConfigError(f"--standby-replicas must be 0 or more, not {standby_replicas}")
    return CheckpointOptions(
        dir=directory,
        interval_s=interval_s,
        state_store=state_store,
        state_max_keys=state_max_keys,
        partition_state_dir=partition_state,
        standby_replicas=standby_replicas,
        from_savepoint=from_savepoint,
        allow_model_change=allow_model_change,
    )
