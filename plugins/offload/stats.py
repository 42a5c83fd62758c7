"""OffloadStats: counts, bytes and seconds of the CPU tier's copies, per kind of copy."""

from __future__ import annotations

from kvx import KVConnectorStats, TransferFigures


class OffloadStats(KVConnectorStats):
    """Per kind of copy (store, load, spill...), summed across workers: `<kind>s`,
    `<kind>_blocks`, `<kind>_bytes`, `<kind>_seconds` and `<kind>_durations` (one entry per
    copy); `load_cpu_tokens` / `load_disk_tokens` (where loads were served from, whole blocks);
    failures `save_errors` (spills that failed) and `load_failures` (requests whose load
    failed)."""

    def count(self, kind: str, nbytes: int, seconds: float, blocks: int = 0) -> None:
        """One copy of `kind` moved `blocks` engine blocks, `nbytes`, in `seconds`."""
        data = self.data
        data[f"{kind}s"] = data.get(f"{kind}s", 0) + 1
        data[f"{kind}_blocks"] = data.get(f"{kind}_blocks", 0) + blocks
        data[f"{kind}_bytes"] = data.get(f"{kind}_bytes", 0) + nbytes
        data[f"{kind}_seconds"] = data.get(f"{kind}_seconds", 0.0) + seconds
        data.setdefault(f"{kind}_durations", []).append(seconds)

    def add(self, key: str, n: int) -> None:
        self.data[key] = self.data.get(key, 0) + n

    def figures(self) -> TransferFigures:
        d = self.data
        return TransferFigures(
            bytes={"saved": int(d.get("store_bytes", 0)), "loaded": int(d.get("load_bytes", 0))},
            blocks={
                "saved": int(d.get("store_blocks", 0)),
                "loaded": int(d.get("load_blocks", 0)),
            },
            seconds={
                "saved": list(d.get("store_durations", [])),
                "loaded": list(d.get("load_durations", [])),
            },
            hits={
                "cpu": int(d.get("load_cpu_tokens", 0)),
                "disk": int(d.get("load_disk_tokens", 0)),
            },
            failures={"transport": int(d.get("save_errors", 0)) + int(d.get("load_failures", 0))},
        )
