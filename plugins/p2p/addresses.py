"""Peer addresses: `host:port` strings and vLLM's legacy request ids that carry them.

vLLM's P2P NCCL proxy names a request `___prefill_addr_<ip:port>___decode_addr_<ip:port>_<id>`;
each worker's peer is `port + rank`. kvx accepts that form for compatibility, parsed strictly
(a request id that starts like it but does not match is an error that says what is expected).
"""

from __future__ import annotations

import ipaddress
import re
from typing import Any

LEGACY_PREFIX = "___prefill_addr_"
_LEGACY = re.compile(
    r"___prefill_addr_(?P<prefill>[^_\s]+:\d{1,5})___decode_addr_(?P<decode>[^_\s]+:\d{1,5})_(?P<rest>.+)",
    re.DOTALL,
)
_HOST = re.compile(r"[A-Za-z0-9.\-]{1,253}")


class AddressError(ValueError):
    """A peer address in a config, a request id or `kv_transfer_params` is not usable."""


def parse_address(text: Any, field: str, allow_zero: bool = False) -> tuple[str, int]:
    """`(host, port)` from `"host:port"` (IPv6 as `[addr]:port`); `AddressError` naming
    `field`, the value and the expected form otherwise. Port 0 only with `allow_zero`."""
    if not isinstance(text, str):
        raise AddressError(f"{field}: {text!r} is not a string; expected 'host:port'")
    host, sep, port = text.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
        valid_host = _is_ip(host)
    else:
        valid_host = bool(_HOST.fullmatch(host)) or _is_ip(host)
    low = 0 if allow_zero else 1
    if not sep or not valid_host or not port.isdigit() or not low <= int(port) <= 65535:
        raise AddressError(
            f"{field}: {text[:100]!r} is not 'host:port' (a host name or IP address, then a "
            "port 1-65535; IPv6 as '[addr]:port')"
        )
    return host, int(port)


def _is_ip(text: str) -> bool:
    try:
        ipaddress.ip_address(text)
    except ValueError:
        return False
    return True


def format_address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def parse_legacy_request_id(request_id: str) -> tuple[tuple[str, int], tuple[str, int]] | None:
    """(prefill, decode) addresses of a vLLM P2P request id; None when the id is not of that
    form; `AddressError` when it starts like one but does not match it exactly."""
    if not request_id.startswith(LEGACY_PREFIX):
        return None
    match = _LEGACY.fullmatch(request_id)
    if match is None:
        raise AddressError(
            f"request id {request_id[:160]!r} starts with {LEGACY_PREFIX!r} but is not "
            "'___prefill_addr_<host:port>___decode_addr_<host:port>_<id>'"
        )
    return (
        parse_address(match["prefill"], "request id prefill_addr"),
        parse_address(match["decode"], "request id decode_addr"),
    )


def decode_address_of(
    request_id: str, params: dict[str, Any] | None, default: str | None
) -> tuple[str, int] | None:
    """Where P sends a request's KV (PUT modes): `kv_transfer_params["decode_address"]`, else
    the legacy request id, else the configured default; None when nothing names one."""
    if params and params.get("decode_address") is not None:
        return parse_address(params["decode_address"], "kv_transfer_params.decode_address")
    legacy = parse_legacy_request_id(request_id)
    if legacy is not None:
        return legacy[1]
    if default is not None:
        return parse_address(default, "default_decode_address")
    return None
