"""ExamplePDConnector: prefill/decode hand-off of whole KV blocks through a shared directory.

The class only names the role's halves: `scheduler.py` decides what to save and load,
`worker.py` writes and reads the files.
"""

from __future__ import annotations

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
    extra_config_schema = ExamplePDConfig  # also checks the extra config when loaded by path
    scheduler_type = ExamplePDScheduler
    worker_type = ExamplePDWorker
    metadata_type = ExamplePDMetadata
    stats_type = ExamplePDStats
