"""What the scheduler half sends the workers each step (plain fields: it may cross processes)."""

from __future__ import annotations

from dataclasses import dataclass

from kvx import LoadsAndStores


@dataclass
class StoreSpec:
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


@dataclass
class ExamplePDMetadata(LoadsAndStores[LoadSpec, StoreSpec]):
    """This step's work: `loads` (D reads P's files) and `stores` (P writes its blocks)."""
