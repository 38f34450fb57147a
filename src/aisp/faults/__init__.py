"""Fault injection: a TCP proxy that delays, throttles, drops, resets or blackholes connections."""

from aisp.faults.proxy import FaultProxy, Faults

__all__ = ["FaultProxy", "Faults"]
