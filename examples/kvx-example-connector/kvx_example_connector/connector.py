"""ExamplePDConnector: prefill/decode hand-off of whole KV blocks through a shared directory.

The class only builds the role's half: `scheduler.py` decides what to save and load,
`worker.py` writes and reads the files.
"""

from __future__ import annotations

from pathlib import Path
from typing import ClassVar

from kvx import Capability, RoleSplitConnector
from kvx_example_connector.config import ExamplePDConfig
from kvx_example_connector.metadata import ExamplePDMetadata
from kvx_example_connector.scheduler import ExamplePDScheduler
from kvx_example_connector.stats import ExamplePDStats
from kvx_example_connector.worker import ExamplePDWorker


class ExamplePDConnector(RoleSplitConnector[ExamplePDScheduler, ExamplePDWorker]):
    """P holds a finished prompt's blocks until its workers wrote them to files; D loads the
    files asynchronously. Same TP, block size and layout on both sides."""

    capabilities: ClassVar[frozenset[Capability]] = frozenset(
        {Capability.REMOTE_PREFILL, Capability.ASYNC_LOAD}
    )
    extra_config_schema = ExamplePDConfig  # checks the extra config when loaded by module path
    metadata_type = ExamplePDMetadata
    stats_type = ExamplePDStats
    worker_type: ClassVar[type[ExamplePDWorker]] = ExamplePDWorker

    def build_scheduler(self) -> ExamplePDScheduler:
        engine_id = str(self.kv_transfer_config.engine_id)
        return ExamplePDScheduler(engine_id, self.engine_context.cache.block_size)

    def build_worker(self) -> ExamplePDWorker:
        options = self.kv_transfer_config.extra_config_as(ExamplePDConfig)
        return self.worker_type(
            Path(options.directory),
            options.load_timeout_s,
            str(self.kv_transfer_config.engine_id),
            self.engine_context,
        )
