"""ExamplePDStats: what a worker's files did since the last report."""

from kvx import KVConnectorStats, TransferFigures


class ExamplePDStats(KVConnectorStats):
    """`files_written`, `files_loaded`, `files_failed` (written or loaded with an error),
    `blocks_written`, `blocks_loaded`, `bytes_written`, `bytes_loaded` and `failed_timeout` /
    `failed_transport` (the failed files by why), summed across workers."""

    def count(self, what: str, n: int = 1) -> None:
        self.data[what] = self.data.get(what, 0) + n

    def figures(self) -> TransferFigures:
        """The shared shape: P's files are what it saved, D's what it loaded."""
        d = self.data
        return TransferFigures(
            bytes={"saved": d.get("bytes_written", 0), "loaded": d.get("bytes_loaded", 0)},
            blocks={"saved": d.get("blocks_written", 0), "loaded": d.get("blocks_loaded", 0)},
            failures={
                "timeout": d.get("failed_timeout", 0),
                "transport": d.get("failed_transport", 0),
            },
        )
