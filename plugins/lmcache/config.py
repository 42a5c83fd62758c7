"""LMCacheConnectorV1's typed extra config (no heavy imports: kvx validates configs with it).

The LMCache options keep LMCache's own names, meanings and defaults (`LMCacheEngineConfig`) and
are passed through to it; kvx adds only `lookup_timeout_s`.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

import msgspec

REMOTE_SCHEMES = ("redis", "lm", "redis-cluster")
_HOST_PORT = re.compile(r"^([a-z-]+)://((?:[^/:,\s]+:\d{1,5},)*[^/:,\s]+):(\d{1,5})/?$")


class LMCacheConfig(msgspec.Struct, forbid_unknown_fields=True):
    """Where LMCache keeps KV chunks and how it cuts them.

    - `chunk_size`: tokens per LMCache chunk (the key granularity); engines sharing a store must
      use the same value. `save_unfull_chunk` also stores a prompt's last, partial chunk.
    - `local_cpu` / `max_local_cpu_size` (GB): LMCache's in-process CPU tier.
    - `local_disk` (`file:///dir/` or a directory) / `max_local_disk_size` (GB): its disk tier.
    - `remote_url`: a shared remote tier, `redis://host:port` or `lm://host:port` (LMCache's own
      server, `python -m lmcache.v1.server HOST PORT cpu`); `remote_serde`: its wire format.
    - `use_layerwise`: store and load one layer at a time, pipelined with the forward pass.
    - `cache_policy`: eviction of the local tiers; `blocking_timeout_secs`: LMCache's wait for a
      remote get.
    - `pre_caching_hash_algorithm`: how chunk keys are hashed. kvx defaults to `sha256_cbor`
      (LMCache's default is `builtin`): where vLLM is installed, LMCache seeds its hash chain
      from vLLM's, and with `builtin` that seed is Python's per-process string hash, so a
      chunk stored by one process is never found by another unless every process shares
      `PYTHONHASHSEED`.
    - `extra_config`: LMCache's free-form `extra_config` dict, passed through unchanged.
    - `lookup_timeout_s` (kvx): how long the scheduler waits for the workers' hit counts.
    """

    chunk_size: Annotated[int, msgspec.Meta(ge=1, le=65536)] = 256
    local_cpu: bool = True
    max_local_cpu_size: Annotated[float, msgspec.Meta(gt=0, le=4096)] = 5.0
    local_disk: str | None = None
    max_local_disk_size: Annotated[float, msgspec.Meta(ge=0, le=1 << 20)] = 0.0
    remote_url: str | None = None
    remote_serde: Literal["naive"] = "naive"
    use_layerwise: bool = False
    save_unfull_chunk: bool = False
    cache_policy: Literal["LRU", "LFU", "FIFO", "MRU"] = "LRU"
    blocking_timeout_secs: Annotated[int, msgspec.Meta(ge=1, le=3600)] = 10
    pre_caching_hash_algorithm: Literal["sha256_cbor", "sha256", "builtin"] = "sha256_cbor"
    extra_config: dict[str, Any] | None = None
    lookup_timeout_s: Annotated[float, msgspec.Meta(gt=0, le=600)] = 10.0

    def __post_init__(self) -> None:
        if self.remote_url is not None:
            match = _HOST_PORT.match(self.remote_url)
            scheme = match.group(1) if match else ""
            if (
                match is None
                or scheme not in REMOTE_SCHEMES
                or ("," in match.group(2) and scheme != "redis-cluster")
            ):
                raise ValueError(
                    f"remote_url: {self.remote_url!r} is not allowed; use "
                    "'redis://host:port', 'lm://host:port' or "
                    "'redis-cluster://host:port[,host:port...]' (LMCache 0.5.6 drops stores to "
                    "fs:// silently: use local_disk for files)"
                )
            ports = [int(p) for p in re.findall(r":(\d+)", self.remote_url.partition("://")[2])]
            for port in ports:
                if not 0 < port < 65536:
                    raise ValueError(f"remote_url: port {port} is not in 1-65535")
        if self.local_disk is not None:
            if not self.local_disk or self.local_disk == "file://":
                raise ValueError(f"local_disk: {self.local_disk!r} names no directory")
            if self.max_local_disk_size <= 0:
                raise ValueError(
                    "max_local_disk_size: 0 with local_disk set; give the disk tier's size in GB "
                    "(e.g. 1.0)"
                )
        if not (self.local_cpu or self.local_disk or self.remote_url):
            raise ValueError(
                "no LMCache backend: set local_cpu: true, local_disk or remote_url (or several)"
            )

    def disk_path(self) -> str | None:
        """The disk tier's directory, with the trailing slash LMCache expects."""
        if self.local_disk is None:
            return None
        path = self.local_disk.removeprefix("file://")
        return path if path.endswith("/") else path + "/"

    def lmcache_options(self) -> dict[str, Any]:
        """Keyword arguments for `LMCacheEngineConfig.from_defaults` (KV events always on: kvx
        reports stores through them)."""
        return {
            "chunk_size": self.chunk_size,
            "local_cpu": self.local_cpu,
            "max_local_cpu_size": self.max_local_cpu_size,
            "local_disk": self.disk_path(),
            "max_local_disk_size": self.max_local_disk_size,
            "remote_url": self.remote_url,
            "remote_serde": self.remote_serde,
            "use_layerwise": self.use_layerwise,
            "save_unfull_chunk": self.save_unfull_chunk,
            "cache_policy": self.cache_policy,
            "blocking_timeout_secs": self.blocking_timeout_secs,
            "pre_caching_hash_algorithm": self.pre_caching_hash_algorithm,
            "extra_config": dict(self.extra_config or {}),
            "enable_kv_events": True,
        }

    def medium(self) -> str:
        """The medium named in KV events: the slowest tier chunks reach."""
        if self.remote_url is not None:
            return self.remote_url.split("://", 1)[0].upper()
        return "DISK" if self.local_disk is not None else "CPU"
