"""Keyed state: key indexes and the columnar state stores operators read and update."""

from aisp.state.keyed import KeyedState, KeyIndex

__all__ = ["KeyIndex", "KeyedState"]
