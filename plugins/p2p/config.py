"""P2pNcclConnector's typed extra config (no heavy imports: kvx validates configs with it).

The listener address and buffer budget are vLLM's top-level `kv_ip`, `kv_port` and
`kv_buffer_size`; everything else is in `kv_connector_extra_config`.
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

from kvx import Secret

SECRET_KEY = "kv_connector_extra_config.shared_secret"
SEND_TYPES = ("PUT", "PUT_ASYNC", "GET")
DATA_PLANES = ("auto", "cpu", "nccl")


class P2pConfig(msgspec.Struct, forbid_unknown_fields=True):
    """How P hands its KV to D.

    - `send_type`: `PUT` (P sends inside `save_kv_layer`), `PUT_ASYNC` (default: a background
      sender, drained by `wait_for_save`) or `GET` (P keeps the KV in a bounded send store and
      D pulls it).
    - `data_plane`: `auto` (NCCL when the KV cache is on CUDA, else CPU), `cpu` or `nccl`.
    - `default_decode_address`: `"host:port"` P pushes to when a request names no decode
      instance (a fixed 1P1D set-up); requests name one in `kv_transfer_params`
      (`decode_address`) or in vLLM's `___prefill_addr_..___decode_addr_..` request id.
    - `mem_pool_size_gb`: host memory received KV may spill into once `kv_buffer_size` bytes
      are buffered; beyond both a PUT is refused and the request fails per
      `kv_load_failure_policy`.
    - `transfer_timeout_s`: how long any exchange with a peer may take;
      `buffer_ttl_s`: how long KV nobody claims (an aborted hand-off) is kept.
    - `shared_secret`: when set, every control message is sealed (HMAC-SHA256) and replays are
      refused; peers without it are refused before their bytes are decoded. Inline, or read
      when the worker starts from `{"env": "NAME"}` or `{"file": "/path"}` (`kvx.resolve_secret`).
    - `max_tensor_bytes`: the largest KV tensor a peer may send or announce.
    - `verify_transfers`: P sends an XXH3-64 digest of every block it hands off and D checks
      the bytes that landed against it; a difference is a load error naming the blocks, under
      `kv_load_failure_policy`. Off by default: it costs more than 10% of D's CPU per
      transfer (docs/connectors/p2p.md gives the measurement). Set it on P and D.
    - `nccl_num_channels`: NCCL_MIN/MAX_NCHANNELS for the pair communicators.
    - `proxy_ip` / `proxy_port` / `http_port`: xPyD service discovery (`kvx proxy`).
    """

    send_type: Literal["PUT", "PUT_ASYNC", "GET"] = "PUT_ASYNC"
    data_plane: Literal["auto", "cpu", "nccl"] = "auto"
    default_decode_address: str | None = None
    mem_pool_size_gb: Annotated[float, msgspec.Meta(ge=0, le=4096)] = 32.0
    transfer_timeout_s: Annotated[float, msgspec.Meta(gt=0, le=3600)] = 30.0
    buffer_ttl_s: Annotated[float, msgspec.Meta(gt=0, le=86400)] = 120.0
    shared_secret: Secret | None = None
    max_tensor_bytes: Annotated[int, msgspec.Meta(ge=1024, le=1 << 40)] = 4 << 30
    nccl_num_channels: Annotated[int, msgspec.Meta(ge=1, le=64)] = 8
    verify_transfers: bool = False  # measured: +34-84% of D's CPU per transfer (p2p.md)
    proxy_ip: str | None = None
    proxy_port: Annotated[int, msgspec.Meta(ge=1, le=65535)] | None = None
    http_port: Annotated[int, msgspec.Meta(ge=1, le=65535)] | None = None

    def __post_init__(self) -> None:
        if self.default_decode_address is not None:
            from kvx.plugins.p2p.addresses import parse_address

            parse_address(self.default_decode_address, "default_decode_address")
        if isinstance(self.shared_secret, str) and len(self.shared_secret) < 8:
            raise ValueError("shared_secret: use at least 8 characters, or null for none")
        if (self.proxy_ip is None) != (self.proxy_port is None):
            raise ValueError(
                f"proxy_ip={self.proxy_ip!r}, proxy_port={self.proxy_port!r}: set both (xPyD "
                "discovery through kvx proxy) or neither"
            )
        if self.proxy_ip is not None and self.http_port is None:
            raise ValueError(
                "http_port: required when proxy_ip is set (the proxy sends requests there)"
            )
