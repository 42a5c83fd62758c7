"""ExampleStoreConnector: KV blocks in one SQLite file that every engine reaches.

The class only names the role's halves: `scheduler.py` decides what to load and store,
`worker.py` reads and writes the rows.
"""

from __future__ import annotations

from typing import ClassVar

from kvx import Capability, RoleSplitConnector
from kvx_example_store.config import ExampleStoreConfig
from kvx_example_store.metadata import ExampleStoreMetadata
from kvx_example_store.scheduler import ExampleStoreScheduler
from kvx_example_store.stats import ExampleStoreStats
from kvx_example_store.worker import ExampleStoreWorker


class ExampleStoreConnector(RoleSplitConnector[ExampleStoreScheduler, ExampleStoreWorker]):
    """Every full prompt block is stored in the step that computed it; an engine asked for a
    prompt loads the stored prefix after its own prefix-cache hit, within the step. Reused by
    a later request (`store_reuse`) or by a decode engine behind a prefill one (`store_pd`).
    Same model, dtype, block size, layout, TP and PP on both sides (part of every key)."""

    capabilities: ClassVar[frozenset[Capability]] = frozenset(
        {Capability.STORE_REUSE, Capability.STORE_PD}
    )
    extra_config_schema = ExampleStoreConfig  # also checks the extra config when loaded by path
    metadata_type = ExampleStoreMetadata
    stats_type = ExampleStoreStats
