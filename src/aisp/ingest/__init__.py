"""Sources: the contract (``Source``/``SourcePartition``), decoding JSON events to columns and
broker messages to batches, generators and process offload. Sources addressed by URL (files,
brokers) are in ``aisp.connectors``."""

from aisp.ingest.base import DeadLetterRecord, Source, SourceContext, SourcePartition
from aisp.ingest.decode import ColumnarDecoder, RawMessage
from aisp.ingest.files import FilesSource
from aisp.ingest.generator import WorkloadFSource
from aisp.ingest.messages import MessageDecoder
from aisp.ingest.testing import TestingSource

__all__ = [
    "ColumnarDecoder",
    "DeadLetterRecord",
    "FilesSource",
    "MessageDecoder",
    "RawMessage",
    "Source",
    "SourceContext",
    "SourcePartition",
    "TestingSource",
    "WorkloadFSource",
]
