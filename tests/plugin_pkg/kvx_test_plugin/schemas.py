"""Typed extra-config schemas (cheap to import: no connector code)."""

from typing import Annotated, Literal

import msgspec


class EchoConfig(msgspec.Struct, forbid_unknown_fields=True):
    """Extra config of EchoConnector."""

    storage_path: str = "/tmp/echo"
    num_threads: Annotated[int, msgspec.Meta(ge=1, le=64)] = 4
    mode: Literal["sync", "async"] = "sync"
    tags: list[str] = []


class CompositeConfig(msgspec.Struct, forbid_unknown_fields=True):
    """Extra config of CompositeConnector besides its `connectors` list."""

    prefer_first: bool = True


class ScriptedConfig(msgspec.Struct, forbid_unknown_fields=True):
    """Extra config of ScriptedConnector: what it answers and does."""

    name: str = "scripted"
    tokens: int = 0
    load_async: bool = False
    hold: bool = False
    params: dict[str, str] = {}
    layout: str | None = None
    finished_count: int | None = None
    load_errors: list[int] = []
