"""AISP: AI-native stream processing.

Build a pipeline with ``Pipeline``/``Stream``, run it with ``Pipeline.run()`` or ``aisp run``.
"""

from aisp.admission.anomaly import AnomalyPolicy
from aisp.batch import Batch, matrix_column
from aisp.connectors.file import JsonlFileSink, JsonlFileSource
from aisp.errors import (
    AispError,
    ConfigError,
    GraphError,
    ModelError,
    ModelTimeoutError,
    SinkError,
    SourceError,
)
from aisp.graph import Graph, Node
from aisp.infer import (
    BatcherConfig,
    LlmSlo,
    LlmSpec,
    ModelRepository,
    OnnxRuntime,
    OpenAIClient,
    PythonRuntime,
    ServedModel,
)
from aisp.ingest import FilesSource, Source, TestingSource, WorkloadFSource
from aisp.pipeline import KeyedStream, Pipeline, Stream
from aisp.runner import CheckpointOptions, ObserveOptions, RunOptions, RunSummary, run
from aisp.schedule.executor import ExecutorOptions
from aisp.sinks import CollectSink, DeadLetterSink, NullSink, Sink
from aisp.transform.windows.aggregates import Aggregate, Count, First, Last, Max, Mean, Min, Std, Sum, Var
from aisp.transform.windows.event_time import EventTime
from aisp.transform.windows.sketches import DistinctCount, Quantile, TopK
from aisp.transform.windows.spec import Session, Sliding, Tumbling

__all__ = [
    "Aggregate",
    "AispError",
    "AnomalyPolicy",
    "Batch",
    "BatcherConfig",
    "CheckpointOptions",
    "CollectSink",
    "ConfigError",
    "Count",
    "DeadLetterSink",
    "DistinctCount",
    "EventTime",
    "ExecutorOptions",
    "FilesSource",
    "First",
    "Graph",
    "GraphError",
    "JsonlFileSink",
    "JsonlFileSource",
    "KeyedStream",
    "Last",
    "LlmSlo",
    "LlmSpec",
    "Max",
    "Mean",
    "Min",
    "ModelError",
    "ModelRepository",
    "ModelTimeoutError",
    "Node",
    "NullSink",
    "ObserveOptions",
    "OnnxRuntime",
    "OpenAIClient",
    "Pipeline",
    "PythonRuntime",
    "Quantile",
    "RunOptions",
    "RunSummary",
    "ServedModel",
    "Session",
    "Sink",
    "SinkError",
    "Sliding",
    "Source",
    "SourceError",
    "Std",
    "Stream",
    "Sum",
    "TestingSource",
    "TopK",
    "Tumbling",
    "Var",
    "WorkloadFSource",
    "matrix_column",
    "run",
]
__version__ = "0.1.0"
