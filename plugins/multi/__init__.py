"""MultiConnector: composes connectors: load from the first with a hit, save to all.

vLLM's MultiConnector semantics.
"""

from kvx.plugins.multi.connector import MultiConnector
from kvx.plugins.multi.metadata import MultiKVConnectorMetadata
from kvx.plugins.multi.stats import MultiKVConnectorStats

__all__ = ["MultiConnector", "MultiKVConnectorMetadata", "MultiKVConnectorStats"]
