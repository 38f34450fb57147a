"""Admission of an inference request, the same for every transport: its timeout (the
transport's deadline, or the OIP ``timeout`` parameter if sooner), the rate limits of its API
key and tier (``Overloaded``, 429 / RESOURCE_EXHAUSTED), and its check against the model's
signature (``oip.check_request``, ``BadRequest``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy.typing as npt

from aisp.errors import Overloaded
from aisp.schedule.ratelimit import Limiter
from aisp.serve.models import ModelServer
from aisp.serve.oip import InferRequest, Signature, check_request

__all__ = ["Admitted", "admit_infer"]


@dataclass(frozen=True)
class Admitted:
    """A request let in: its checked arrays and the options for ``ModelServer.infer``."""

    arrays: dict[str, npt.NDArray[Any]]
    options: dict[str, Any] = field(default_factory=dict)


def admit_infer(
    models: ModelServer,
    limiter: Limiter | None,
    req: InferRequest,
    sig: Signature,
    *,
    version: str | None,
    tier: int | None,
    timeout_s: float | None,
    api_key: str,
) -> Admitted:
    """Admit ``req`` for model ``sig.model`` or raise why not (see the module docstring)."""
    if req.timeout_us is not None:
        timeout_s = min(timeout_s or float("inf"), req.timeout_us / 1e6)
    if limiter is not None:
        rows = int(req.inputs[0].shape[0]) if req.inputs and req.inputs[0].shape else 1
        level = tier if tier is not None else models.tier_of(sig.model, req.priority)
        wait = limiter.admit(api_key, level, rows)
        if wait:
            raise Overloaded(f"rate limit: retry in {wait:.3f} s", retry_after_s=wait)
    options = {
        "version": version,
        "priority": req.priority,
        "tier": tier,
        "timeout_s": timeout_s,
        "checked": True,
    }
    return Admitted(check_request(req, sig), options)
