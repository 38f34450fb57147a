"""JSON-lines files (``file://PATH`` or a plain path) and ``null:``."""

from aisp.connectors.file.connector import FileConnector
from aisp.connectors.file.sink import JsonlFileSink
from aisp.connectors.file.source import JsonlFileSource

CONNECTOR = FileConnector()

__all__ = ["CONNECTOR", "FileConnector", "JsonlFileSink", "JsonlFileSource"]
