"""What the scheduler half sends the workers each step (plain fields: it may cross processes)."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvx import KVConnectorMetadata


@dataclass
class ExamplePDMetadata(KVConnectorMetadata):
    """This step's saves (P) and loads (D)."""

    saves: list[SaveSpec] = field(default_factory=list)
    loads: list[LoadSpec] = field(default_factory=list)


@dataclass
class SaveSpec:
    """P: write these blocks of a finished request to its file."""

    req_id: str
    block_ids: list[int]


@dataclass
class LoadSpec:
    """D: read P's file of `remote_request_id` into `local_block_ids`."""

    req_id: str
    local_block_ids: list[int]
    remote_engine_id: str
    remote_request_id: str
    remote_block_ids: list[int]
