"""Which network interface holds an address, so UCX listens only where the config says.

UCX's TCP transport opens a listening socket on every interface it uses, and by default it
uses all of them. NIXL has no listen-address option; UCX's `UCX_NET_DEVICES` names the
interfaces it may use. `side_channel_host` is mapped to its interface: loopback (the default)
to `lo`, an interface address to that interface, the wildcard (`0.0.0.0`, `::`) to all.
"""

from __future__ import annotations

import fcntl
import ipaddress
import socket
import struct
from pathlib import Path

SIOCGIFADDR = 0x8915
UCX_NET_DEVICES = "UCX_NET_DEVICES"


def interface_of(host: str) -> str | None:
    """The name of the interface holding address `host`; None for the wildcard address.

    Raises ValueError when no interface of this machine has that address.
    """
    address = ipaddress.ip_address(host)
    if address.is_unspecified:
        return None
    for name, held in _addresses():
        if held == address or (address.is_loopback and held.is_loopback):
            return name
    if address.is_loopback:
        return "lo"
    raise ValueError(
        f"no network interface of this machine has the address {host}; use one of "
        f"{sorted({str(a) for _, a in _addresses()})} or 0.0.0.0 for all"
    )


def _addresses() -> list[tuple[str, ipaddress.IPv4Address | ipaddress.IPv6Address]]:
    """(interface, address) for the primary IPv4 address and every IPv6 address."""
    found: list[tuple[str, ipaddress.IPv4Address | ipaddress.IPv6Address]] = []
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        for _, name in socket.if_nameindex():
            request = struct.pack("256s", name.encode()[:15])
            try:
                reply = fcntl.ioctl(sock.fileno(), SIOCGIFADDR, request)
            except OSError:  # no IPv4 address
                continue
            found.append((name, ipaddress.IPv4Address(reply[20:24])))
    inet6 = Path("/proc/net/if_inet6")
    if inet6.exists():
        for line in inet6.read_text().splitlines():
            fields = line.split()
            if len(fields) == 6:
                found.append((fields[5], ipaddress.IPv6Address(bytes.fromhex(fields[0]))))
    return found
