"""Connectors addressed by URL, as the command line names them (``--input``, ``--output``,
``--dead-letter``, drift alert targets, ``aisp bench`` and ``aisp chaos``).

One folder per scheme, each with its source, sink, URL options and the helpers of tests,
scenarios and load (see ``Connector``); one registry resolves a URL to its connector:

* a plain path or ``file://PATH``: JSON lines; ``null:``: an output that only counts
  (``aisp.connectors.file``);
* ``redis://HOST:PORT/STREAM``: Redis Streams (``aisp.connectors.redis``);
* ``kafka://HOST:PORT/TOPIC``: Kafka (``aisp.connectors.kafka``);
* ``nats://HOST:PORT/STREAM``: NATS JetStream (``aisp.connectors.nats``).

Each scheme's module docstring lists its URL options.
"""

from aisp.connectors.base import Connector, LoadClient, Pipeline, PrivateBroker
from aisp.connectors.registry import (
    alert_to,
    connector_for,
    dead_letter_sink,
    register,
    schemes,
    sink_for,
    source_for,
)

__all__ = [
    "Connector",
    "LoadClient",
    "Pipeline",
    "PrivateBroker",
    "alert_to",
    "connector_for",
    "dead_letter_sink",
    "register",
    "schemes",
    "sink_for",
    "source_for",
]
