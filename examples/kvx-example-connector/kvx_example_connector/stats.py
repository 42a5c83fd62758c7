"""ExamplePDStats: what a worker's files did since the last report."""

from kvx import KVConnectorStats


class ExamplePDStats(KVConnectorStats):
    """`files_written`, `files_loaded` and `files_failed` (written or loaded with an error),
    summed across workers."""

    def count(self, what: str) -> None:
        self.data[what] = self.data.get(what, 0) + 1
