"""Checks shared by the connectors' option tests: every option a URL may give reaches the source
or sink it configures, and an option left out leaves that one's own default."""

from __future__ import annotations

import dataclasses
from typing import Any

import msgspec

from aisp.connectors.access import SecuredOptions
from aisp.connectors.url import UrlOptions, _kind

RENAMED = {"idle_stop_s": "stop_when_idle_s"}  # the URL's name -> the source's field


def sample(kind: type) -> tuple[str, Any]:
    """A URL text for an option of type ``kind`` and the value it should become."""
    return {str: ("v-1", "v-1"), int: ("7", 7), float: ("2.5", 2.5), bool: ("yes", True)}[kind]


def check_options_reach(options: type[UrlOptions], build: Any, base_url: str, built_type: type) -> None:
    """Each option of ``options`` given alone in ``base_url`` shows on what ``build(url)``
    returns; with none given, that equals ``built_type``'s defaults."""
    defaults = {f.name: f.default for f in dataclasses.fields(built_type)}
    bare = build(base_url)
    for field in msgspec.structs.fields(options):
        if field.name in (*SecuredOptions.__struct_fields__, *getattr(options, "ACCESS", ())):
            continue  # they make the built one's ``access`` (tests/unit/connectors/test_access.py)
        name = RENAMED.get(field.name, field.name)
        assert name in defaults, f"{options.__name__}.{field.name} has no field {name} on {built_type}"
        assert getattr(bare, name) == defaults[name], name  # left out: the built one's default
        text, value = sample(_kind(field.type))
        sep = "&" if "?" in base_url else "?"
        assert getattr(build(f"{base_url}{sep}{field.name}={text}"), name) == value, name
