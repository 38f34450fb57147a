"""The barrier's drain: it waits for the rows in flight, or, bounded, gives up and says the
state is not consistent (a revoke then writes nothing)."""

from __future__ import annotations

import threading

from aisp.schedule.checkpointing.coordinator import Flight


def test_a_bounded_drain_gives_up_on_rows_still_in_flight_and_a_drain_ends_when_they_land() -> None:
    flight = Flight(threading.Event(), [], lambda: False)
    flight.landed(5)
    flight.drain(0.05)
    assert not flight.consistent()
    threading.Timer(0.1, flight.landed, args=(-5,)).start()
    flight.drain()
    assert flight.consistent()
