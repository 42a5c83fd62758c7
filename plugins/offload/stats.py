"""OffloadStats: counts, bytes and seconds of the CPU tier's copies, per kind of copy."""

from __future__ import annotations

from kvx import KVConnectorStats


class OffloadStats(KVConnectorStats):
    """`<kind>s`, `<kind>_bytes` and `<kind>_seconds` per kind of copy (store, load, spill...),
    summed across workers."""

    def count(self, kind: str, nbytes: int, seconds: float) -> None:
        """One copy of `kind` moved `nbytes` in `seconds`."""
        data = self.data
        data[f"{kind}s"] = data.get(f"{kind}s", 0) + 1
        data[f"{kind}_bytes"] = data.get(f"{kind}_bytes", 0) + nbytes
        data[f"{kind}_seconds"] = data.get(f"{kind}_seconds", 0.0) + seconds
