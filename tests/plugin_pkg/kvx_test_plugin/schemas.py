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
