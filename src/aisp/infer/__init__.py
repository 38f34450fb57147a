"""Model inference: runtimes, the dynamic batcher and the infer step's column glue."""

from aisp.infer.batching.adaptive import AdaptiveConfig, AdaptiveTuner
from aisp.infer.batching.batcher import (
    BatcherClosed,
    BatcherConfig,
    BatcherStats,
    BatchQueue,
    DeadLetter,
    DynamicBatcher,
    Emit,
    Finish,
    OnBatch,
    Prepare,
    QueueFull,
)
from aisp.infer.llm.client import Generation, LlmClient, LlmError, OpenAIClient
from aisp.infer.llm.stage import LlmSlo, LlmSpec, LlmStage
from aisp.infer.models.repository import (
    ModelConfig,
    ModelRepository,
    TensorConfig,
    UnsupportedConfigWarning,
    VersionPolicy,
    priority_to_tier,
)
from aisp.infer.models.versions import ServedModel
from aisp.infer.runtimes.base import CostModel, OnnxRuntime, PythonRuntime, Runtime, TensorSpec, resolve
from aisp.infer.stage import InferSpec, build_batcher, build_io

__all__ = [
    "AdaptiveConfig",
    "AdaptiveTuner",
    "BatchQueue",
    "BatcherClosed",
    "BatcherConfig",
    "BatcherStats",
    "CostModel",
    "DeadLetter",
    "DynamicBatcher",
    "Emit",
    "Finish",
    "Generation",
    "InferSpec",
    "LlmClient",
    "LlmError",
    "LlmSlo",
    "LlmSpec",
    "LlmStage",
    "ModelConfig",
    "ModelRepository",
    "OnBatch",
    "OnnxRuntime",
    "OpenAIClient",
    "Prepare",
    "PythonRuntime",
    "QueueFull",
    "Runtime",
    "ServedModel",
    "TensorConfig",
    "TensorSpec",
    "UnsupportedConfigWarning",
    "VersionPolicy",
    "build_batcher",
    "build_io",
    "priority_to_tier",
    "resolve",
]
