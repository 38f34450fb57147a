"""Sources: generators and files (brokers and network ingest build on the same contract)."""

from aisp.ingest.base import DeadLetterRecord, Source, SourceContext, SourcePartition
from aisp.ingest.decode import ColumnarDecoder
from aisp.ingest.generator import WorkloadFSource
from aisp.ingest.jsonl import JsonlFileSource

__all__ = [
    "ColumnarDecoder",
    "DeadLetterRecord",
    "JsonlFileSource",
    "Source",
    "SourceContext",
    "SourcePartition",
    "WorkloadFSource",
]
