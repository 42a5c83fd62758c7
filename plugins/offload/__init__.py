"""OffloadingConnector: offloads KV chunks to a CPU tier (LRU or ARC) and loads them back async."""

from kvx.plugins.offload.connector import OffloadingConnector

__all__ = ["OffloadingConnector"]
