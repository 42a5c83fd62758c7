"""ExampleStoreStats: what a worker's store did since the last report."""

from kvx import KVConnectorStats, TransferFigures


class ExampleStoreStats(KVConnectorStats):
    """`blocks_saved`, `blocks_loaded`, `bytes_saved`, `bytes_loaded`, and the blocks a load
    did not find (`blocks_missing`) or could not use (`blocks_unreadable`), summed across
    workers."""

    def count(self, what: str, n: int = 1) -> None:
        self.data[what] = self.data.get(what, 0) + n

    def figures(self) -> TransferFigures:
        """The shared shape."""
        d = self.data
        return TransferFigures(
            bytes={"saved": d.get("bytes_saved", 0), "loaded": d.get("bytes_loaded", 0)},
            blocks={"saved": d.get("blocks_saved", 0), "loaded": d.get("blocks_loaded", 0)},
            failures={
                "store_miss": d.get("blocks_missing", 0),
                "transport": d.get("blocks_unreadable", 0),
            },
        )
