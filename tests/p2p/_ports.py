"""Free TCP port ranges for P2P listeners (`kv_port + rank`): random, never fixed."""

from __future__ import annotations

import random
import socket


def free_port_range(count: int = 8) -> int:
    """A base port with `count` consecutive ports free on 127.0.0.1 right now."""
    rng = random.SystemRandom()
    for _ in range(200):
        base = rng.randrange(20000, 60000 - count)
        sockets = []
        try:
            for i in range(count):
                s = socket.socket()
                sockets.append(s)
                s.bind(("127.0.0.1", base + i))
            return base
        except OSError:
            continue
        finally:
            for s in sockets:
                s.close()
    raise RuntimeError(f"no {count} consecutive free ports found")


def p2p_config(send_type: str, port: int, **extra: object) -> dict[str, object]:
    """A connector config both P and D can share: D (PUT modes) or P (GET) listens on `port`."""
    options: dict[str, object] = {"send_type": send_type, "transfer_timeout_s": 5, **extra}
    if send_type != "GET":
        options.setdefault("default_decode_address", f"127.0.0.1:{port}")
    return {
        "kv_connector": "P2pNcclConnector",
        "kv_port": port,
        "kv_connector_extra_config": options,
    }
