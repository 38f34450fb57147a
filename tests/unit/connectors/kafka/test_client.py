"""The guard around Kafka client calls that may block past their own timeout."""

from __future__ import annotations

import threading
import time

import pytest

from aisp.connectors.kafka.client import CLIENT_SETTINGS, CallStuck, bounded, error_code, is_unknown_topic


def test_a_call_that_returns_gives_its_result_and_one_that_raises_its_exception() -> None:
    assert bounded("add", lambda: 1 + 1, 5.0) == 2
    with pytest.raises(ZeroDivisionError):
        bounded("divide", lambda: 1 / 0, 5.0)


def test_a_call_that_never_returns_is_given_up_after_its_bound_and_left_to_its_thread() -> None:
    release = threading.Event()
    try:
        started = time.monotonic()
        with pytest.raises(CallStuck, match="send_offsets_to_transaction did not return within 0.2 s"):
            bounded("send_offsets_to_transaction", release.wait, 0.2)
        assert time.monotonic() - started >= 0.2
        stuck = [t for t in threading.enumerate() if t.name == "aisp-kafka-send_offsets_to_transaction"]
        assert stuck and all(t.daemon for t in stuck)  # it does not keep the process up
    finally:
        release.set()


def test_clients_do_not_rebootstrap_into_the_coordinator_hang() -> None:
    from confluent_kafka import Producer

    assert CLIENT_SETTINGS["metadata.recovery.strategy"] == "none"
    Producer({"bootstrap.servers": "127.0.0.1:1", **CLIENT_SETTINGS})  # librdkafka knows the setting


def test_errors_are_told_apart_by_their_code_not_their_text() -> None:
    from confluent_kafka import KafkaError, KafkaException

    exists = KafkaException(
        KafkaError(KafkaError.TOPIC_ALREADY_EXISTS, "Topic with this name already exists.")
    )
    assert error_code(exists) == KafkaError.TOPIC_ALREADY_EXISTS and not is_unknown_topic(exists)
    # the same text with another code is another error; another text with the code is the same
    assert error_code(KafkaException(KafkaError(KafkaError.INVALID_CONFIG, "already exists"))) != (
        KafkaError.TOPIC_ALREADY_EXISTS
    )
    for code in (KafkaError.UNKNOWN_TOPIC_OR_PART, KafkaError._UNKNOWN_TOPIC, KafkaError.UNKNOWN_TOPIC_ID):
        assert is_unknown_topic(KafkaException(KafkaError(code, "anything")))
    assert error_code(RuntimeError("UNKNOWN_TOPIC_OR_PART")) is None
    assert not is_unknown_topic(RuntimeError("Broker: Unknown topic or partition"))
