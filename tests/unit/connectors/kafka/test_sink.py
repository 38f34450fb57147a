"""The Kafka sink's delivery reports (no broker: the report callback alone)."""

from __future__ import annotations

from typing import Any

from aisp.connectors.kafka.sink import _KafkaWriter


class _Report:
    def __init__(self, partition: int, offset: int | None) -> None:
        self._partition, self._offset = partition, offset

    def partition(self) -> int:
        return self._partition

    def offset(self) -> int | None:
        return self._offset


def _writer() -> Any:
    writer = object.__new__(_KafkaWriter)  # the report callback needs only these
    writer._next, writer._errors = {}, []
    return writer


def test_a_report_without_an_offset_does_not_raise_and_does_not_move_the_position() -> None:
    """An idempotent producer's retry that the broker had already written is reported delivered
    without an offset; the callback raised on it, and confluent-kafka made that a SystemError
    from ``flush`` that stopped the run."""
    writer = _writer()
    writer._delivered(None, _Report(0, 5))
    writer._delivered(None, _Report(0, None))
    writer._delivered(None, _Report(1, -1001))
    writer._delivered(None, _Report(0, 4))  # reports may come out of order: the position keeps the max
    assert writer._next == {0: 6} and writer._errors == []


def test_a_failed_delivery_and_a_broken_report_become_errors_not_exceptions() -> None:
    writer = _writer()
    writer._delivered("Local: Message timed out", _Report(0, None))
    writer._delivered(None, object())  # not a message: the callback still does not raise
    assert writer._errors[0] == "Local: Message timed out"
    assert writer._errors[1].startswith("a delivery report failed: AttributeError")
