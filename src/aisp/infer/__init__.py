"""Model inference: runtimes, the dynamic batcher and the infer step's column glue."""

from aisp.infer.batcher import (
    BatcherConfig,
    BatcherStats,
    BatchQueue,
    DeadLetter,
    DynamicBatcher,
    Emit,
    Finish,
    OnBatch,
    Prepare,
)
from aisp.infer.runtime import CostModel, OnnxRuntime, PythonRuntime, Runtime, TensorSpec
from aisp.infer.stage import InferSpec, build_batcher, build_io

__all__ = [
    "BatchQueue",
    "BatcherConfig",
    "BatcherStats",
    "CostModel",
    "DeadLetter",
    "DynamicBatcher",
    "Emit",
    "Finish",
    "InferSpec",
    "OnBatch",
    "OnnxRuntime",
    "Prepare",
    "PythonRuntime",
    "Runtime",
    "TensorSpec",
    "build_batcher",
    "build_io",
]
