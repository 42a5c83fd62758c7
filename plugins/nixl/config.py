"""NixlConnector's typed extra config (no heavy imports: kvx validates configs with it)."""

from __future__ import annotations

import ipaddress
from typing import Annotated, Literal

import msgspec

NIXL_BACKENDS = ("UCX", "POSIX", "GDS", "GDS_MT", "LIBFABRIC", "UCCL", "OBJ")


class NixlConfig(msgspec.Struct, forbid_unknown_fields=True):
    """How P serves its handshake and holds blocks, and how D reads them.

    - `side_channel_host` / `side_channel_port`: where P's scheduler serves the workers'
      handshake payloads (ZMQ). Port 0 picks a free port, advertised to D in the request's
      `kv_transfer_params`. Loopback unless you set another address.
    - `kv_lease_duration`: seconds P keeps a finished prompt's blocks for D to read; D's
      heartbeats (every lease/6 s) extend it while D waits (matches vLLM's `kv_lease_duration`).
    - `handshake_timeout_s`: how long D waits for P's side channel before the request's blocks
      are reported as load errors; `transfer_timeout_s`: how long a READ may take.
    - `enforce_handshake_compat`: refuse a peer whose compatibility hash differs.
    - `shared_secret`: when set, both sides prove knowledge of it (HMAC-SHA256) in the handshake.
    - `max_handshake_bytes`: the largest handshake reply D accepts.
    - `required_layout`: the KV layout the connector asks the engine to allocate ("HND": a TP
      head slice of a block is one contiguous byte range); null accepts the engine's layout and
      converts on receive.
    - `backends`: NIXL backends to instantiate; `num_threads`: backend threads (0: default).
    - `idle_progress`: P keeps NIXL progressing from a thread while it holds blocks and its
      engine does not poll (D's reads stall on an idle P otherwise).
    """

    side_channel_host: str = "127.0.0.1"
    side_channel_port: Annotated[int, msgspec.Meta(ge=0, le=65535)] = 0
    kv_lease_duration: Annotated[float, msgspec.Meta(gt=0, le=86400)] = 30.0
    handshake_timeout_s: Annotated[float, msgspec.Meta(gt=0, le=600)] = 5.0
    transfer_timeout_s: Annotated[float, msgspec.Meta(gt=0, le=3600)] = 30.0
    enforce_handshake_compat: bool = True
    shared_secret: str | None = None
    max_handshake_bytes: Annotated[int, msgspec.Meta(ge=1024, le=1 << 30)] = 16 << 20
    required_layout: Literal["HND"] | None = "HND"
    backends: list[str] = msgspec.field(default_factory=lambda: ["UCX"])
    num_threads: Annotated[int, msgspec.Meta(ge=0, le=64)] = 0
    idle_progress: bool = True

    def __post_init__(self) -> None:
        try:
            ipaddress.ip_address(self.side_channel_host)
        except ValueError:
            raise ValueError(
                f"side_channel_host: {self.side_channel_host!r} is not an IP address; use e.g. "
                "'127.0.0.1' (default, this machine only) or the address of an interface"
            ) from None
        unknown = [b for b in self.backends if b not in NIXL_BACKENDS]
        if unknown or not self.backends:
            raise ValueError(
                f"backends: {self.backends!r} is not allowed; pick one or more of "
                f"{list(NIXL_BACKENDS)} (UCX is what works on CPU-only machines)"
            )
        if self.shared_secret is not None and len(self.shared_secret) < 8:
            raise ValueError("shared_secret: use at least 8 characters, or null for none")
