from __future__ import annotations

import importlib

import pytest

import aisp

SUBPACKAGES = [
    "aisp",
    "aisp.infer",
    "aisp.ingest",
    "aisp.sinks",
    "aisp.transform",
    "aisp.state",
    "aisp.observe",
]


@pytest.mark.parametrize("name", SUBPACKAGES)
def test_all_is_sorted_and_complete(name: str) -> None:
    mod = importlib.import_module(name)
    exported = list(mod.__all__)
    assert exported == sorted(exported), f"{name}.__all__ is not sorted"
    for item in exported:
        assert hasattr(mod, item), f"{name}.__all__ names {item!r}, which it does not define"
    public = {
        k
        for k, v in vars(mod).items()
        if not k.startswith("_") and getattr(v, "__module__", "").startswith("aisp")
    }
    assert public <= set(exported), (
        f"{name} defines public names missing from __all__: {public - set(exported)}"
    )


def test_version() -> None:
    assert aisp.__version__ == "0.1.0"
