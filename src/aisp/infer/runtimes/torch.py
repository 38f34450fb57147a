"""PyTorch models as runtimes (optional extra ``aisp[torch]``).

``TorchRuntime`` runs an exported program (``.pt2``, ``torch.export.load``), a TorchScript
archive (``torch.jit.load``: code and tensors, no arbitrary Python objects) or an ``nn.Module``
built in code, optionally with weights from a ``state_dict`` file loaded with
``torch.load(weights_only=True)``. Nothing is ever unpickled with
``weights_only=False``. Calls run under ``torch.inference_mode()``; torch releases the GIL
inside its kernels, so the next batch forms while one computes.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from aisp.errors import ConfigError, ModelError
from aisp.infer.runtimes.base import TensorSpec, check_rows, file_sha256, warmup_with_zeros

__all__ = ["TorchRuntime"]


class TorchRuntime:
    """A PyTorch model.

    Args:
        model: a ``torch.export`` program (``.pt2``), a TorchScript file (``.pt``/``.ts``), or an
            ``nn.Module`` instance.
        input_names: names of the model's positional inputs, in order.
        output_names: names for its outputs (a tensor, or a tuple/list of tensors, in order).
        input_specs: dtype and shape per input (shape with ``None`` for the batch); needed for
            warm-up.
        weights: with an ``nn.Module``: a ``state_dict`` file, loaded with ``weights_only=True``.
        device: ``"cpu"`` or ``"cuda"`` (``"cuda:N"``) when torch has it.

    ``weights_sha256``: the SHA-256 of the model file (or of ``weights``), computed at load, which
    checkpoints record and restores check; empty for a module given without a weights file.
    """

    def __init__(
        self,
        model: Any,
        *,
        input_names: Sequence[str],
        output_names: Sequence[str],
        input_specs: Mapping[str, TensorSpec] | None = None,
        weights: str | Path | None = None,
        name: str | None = None,
        version: str = "1",
        device: str = "cpu",
    ) -> None:
        try:
            import torch
        except ImportError as exc:
            raise ConfigError("TorchRuntime needs PyTorch: pip install 'aisp[torch]'") from exc
        self._torch = torch
        self.device = torch.device(device)
        if isinstance(model, str | Path):
            path = Path(model)
            if weights is not None:
                raise ConfigError("weights= applies to an nn.Module, not to a model file")
            try:
                module = self._load_file(path)
            except Exception as exc:
                raise ModelError(
                    f"cannot load PyTorch model {str(path)!r}: {type(exc).__name__}: {exc}"
                ) from exc
            self.name = name or path.stem
        else:
            module = model
            if weights is not None:
                try:
                    state = torch.load(str(weights), map_location=self.device, weights_only=True)
                    module.load_state_dict(state)
                except Exception as exc:
                    raise ModelError(
                        f"cannot load weights {str(weights)!r}: {type(exc).__name__}: {exc}"
                    ) from exc
            module = module.to(self.device).eval()
            self.name = name or type(model).__name__
        self._module = module
        self.version = version
        source = model if isinstance(model, str | Path) else weights
        self.weights_sha256 = file_sha256(source) if source is not None else ""
        self.input_names = tuple(input_names)
        self.output_names = tuple(output_names)
        self.input_specs: Mapping[str, TensorSpec] = dict(input_specs or {})
        self.provider = f"torch:{self.device}"

    def _load_file(self, path: Path) -> Any:
        torch = self._torch
        if path.suffix == ".pt2":
            return torch.export.load(str(path)).module().to(self.device)  # exported: already inference-only
        with warnings.catch_warnings():  # TorchScript is deprecated upstream; loading it is the user's choice
            warnings.simplefilter("ignore", DeprecationWarning)
            return torch.jit.load(str(path), map_location=self.device).eval()  # type: ignore[no-untyped-call]

    def run(self, inputs: Mapping[str, npt.NDArray[Any]]) -> dict[str, npt.NDArray[Any]]:
        torch = self._torch
        try:
            args = [torch.from_numpy(_writable(inputs[n])).to(self.device) for n in self.input_names]
            with torch.inference_mode():
                result = self._module(*args)
        except Exception as exc:
            raise ModelError(f"model {self.name!r} failed: {type(exc).__name__}: {exc}") from exc
        tensors = list(result) if isinstance(result, tuple | list) else [result]
        if len(tensors) != len(self.output_names):
            raise ModelError(
                f"model {self.name!r} returned {len(tensors)} outputs, expected {list(self.output_names)}"
            )
        outputs = {n: t.detach().cpu().numpy() for n, t in zip(self.output_names, tensors, strict=True)}
        check_rows(self.name, inputs, outputs)
        return outputs

    def warmup(self, batch_sizes: Sequence[int]) -> None:
        warmup_with_zeros(self, batch_sizes)

    def __repr__(self) -> str:
        return f"TorchRuntime({self.name!r}, provider={self.provider!r})"


def _writable(arr: npt.NDArray[Any]) -> npt.NDArray[Any]:
    """Torch wants writable arrays; Arrow-backed columns are read-only views, so copy those."""
    arr = np.ascontiguousarray(arr)
    return arr if arr.flags.writeable else arr.copy()
