"""NixlConnector's typed extra config (no heavy imports: kvx validates configs with it)."""

from __future__ import annotations

import ipaddress
import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Annotated, Literal

import msgspec

from kvx import ConfigError, ConfigProblem, Secret

HOST_ENV, PORT_ENV = "VLLM_NIXL_SIDE_CHANNEL_HOST", "VLLM_NIXL_SIDE_CHANNEL_PORT"
DEFAULT_HOST = "127.0.0.1"
SECRET_KEY = "kv_connector_extra_config.shared_secret"
MIN_SECRET_LENGTH = 8
MAX_PRECONNECT = 64
NIXL_BACKENDS = ("UCX", "POSIX", "GDS", "GDS_MT", "LIBFABRIC", "UCCL", "OBJ")


class NixlConfig(msgspec.Struct, forbid_unknown_fields=True):
    """How P serves its handshake and holds blocks, and how D reads them.

    - `side_channel_host` / `side_channel_port`: where P's scheduler serves the workers'
      handshake payloads (ZMQ). Port 0 picks a free port, advertised to D in the request's
      `kv_transfer_params`. Loopback unless you set another address. When left out they come
      from vLLM's `VLLM_NIXL_SIDE_CHANNEL_HOST` / `VLLM_NIXL_SIDE_CHANNEL_PORT` if set
      (the config wins over the environment); `"localhost"` means 127.0.0.1.
    - `kv_lease_duration`: seconds P keeps a finished prompt's blocks for D to read; D's
      heartbeats (every lease/6 s) extend it while D waits (matches vLLM's `kv_lease_duration`).
    - `handshake_timeout_s`: how long D waits for P's side channel before the request's blocks
      are reported as load errors; `transfer_timeout_s`: how long a READ may take.
    - `enforce_handshake_compat`: refuse a peer whose compatibility hash differs.
    - `shared_secret`: when set, both sides prove knowledge of it (HMAC-SHA256) in the handshake;
      inline, or read from `{"env": "NAME"}` or `{"file": "/path"}` (see `kvx.resolve_secret`).
    - `max_handshake_bytes`: the largest handshake reply D accepts.
    - `required_layout`: the KV layout the connector asks the engine to allocate ("HND": a TP
      head slice of a block is one contiguous byte range); null accepts the engine's layout and
      converts on receive.
    - `backends`: NIXL backends to instantiate; `num_threads`: backend threads (0: default).
    - `idle_progress`: P keeps NIXL progressing from a thread while it holds blocks and its
      engine does not poll (D's reads stall on an idle P otherwise).
    - `verify_transfers`: P digests every block it hands off per head (XXH3-64), D checks the
      heads it read against them; a difference is a load error naming the blocks, under
      `kv_load_failure_policy`. Off by default: it costs more than 10% of D's CPU per read
      (docs/connectors/nixl.md gives the measurement). Set it on P and D.
    - `huge_pages`: move a CPU KV cache onto transparent huge pages before registering it
      (Linux `MADV_COLLAPSE`; one copy at start-up): same-machine reads then pin one page per
      2 MiB instead of per 4 KiB.
    - `transfer_mode`: "pull" (D READs P's blocks) or "push" (D registers its blocks with P,
      which WRITEs them and notifies D; vLLM's `NixlPushConnector`). Both sides must agree.
    - `preconnect`: D only: the side channels (`host:port`) of P engines to shake hands with
      at start-up, in the background, so the first request from each pays no handshake.
    - `start_reads_at_bind`: with a CPU KV cache, start D's READs before the step's forward
      pass instead of after it (vLLM's order), so one that ends during the step is seen then.
    """

    side_channel_host: str | None = None
    side_channel_port: Annotated[int, msgspec.Meta(ge=0, le=65535)] | None = None
    kv_lease_duration: Annotated[float, msgspec.Meta(gt=0, le=86400)] = 30.0
    handshake_timeout_s: Annotated[float, msgspec.Meta(gt=0, le=600)] = 5.0
    transfer_timeout_s: Annotated[float, msgspec.Meta(gt=0, le=3600)] = 30.0
    enforce_handshake_compat: bool = True
    shared_secret: Secret | None = None
    max_handshake_bytes: Annotated[int, msgspec.Meta(ge=1024, le=1 << 30)] = 16 << 20
    required_layout: Literal["HND"] | None = "HND"
    backends: list[str] = msgspec.field(default_factory=lambda: ["UCX"])
    num_threads: Annotated[int, msgspec.Meta(ge=0, le=64)] = 0
    idle_progress: bool = True
    huge_pages: bool = True
    verify_transfers: bool = False  # costs more than 10% of D's CPU per read (nixl.md)
    transfer_mode: Literal["pull", "push"] = "pull"
    start_reads_at_bind: bool = True
    preconnect: Annotated[list[str], msgspec.Meta(max_length=MAX_PRECONNECT)] = msgspec.field(
        default_factory=list
    )

    def __post_init__(self) -> None:
        if self.side_channel_host is not None:
            problem = host_problem(self.side_channel_host)
            if problem is not None:
                raise ValueError(f"side_channel_host: {problem}")
        unknown = [b for b in self.backends if b not in NIXL_BACKENDS]
        if unknown or not self.backends:
            raise ValueError(
                f"backends: {self.backends!r} is not allowed; pick one or more of "
                f"{list(NIXL_BACKENDS)} (UCX is what works on CPU-only machines)"
            )
        for address in self.preconnect:
            try:
                host, _ = split_address(address)
            except ValueError as exc:
                raise ValueError(f"preconnect: {exc}") from None
            problem = host_problem(host)
            if problem is not None:
                raise ValueError(f"preconnect: {address[:100]!r}: {problem}")
        if isinstance(self.shared_secret, str) and len(self.shared_secret) < MIN_SECRET_LENGTH:
            raise ValueError(
                f"shared_secret: use at least {MIN_SECRET_LENGTH} characters, or null for none"
            )

    def config_notes(self) -> list[ConfigProblem]:
        """Where the side channel's address comes from (`kvx validate` prints these)."""
        address = side_channel_address(self)
        notes = []
        for key, value, origin in (
            ("side_channel_host", address.host, address.host_from),
            ("side_channel_port", address.port, address.port_from),
        ):
            if origin not in ("config", "default"):
                given = os.environ.get(origin, "")
                notes.append(
                    ConfigProblem(
                        key,
                        f"{value} from {origin}={given} (the key is not in the config, which "
                        "would win over the environment)",
                    )
                )
        if self.side_channel_host == "localhost":
            notes.append(ConfigProblem("side_channel_host", '"localhost" is 127.0.0.1'))
        return notes

    def config_checks(self) -> list[ConfigProblem]:
        """`kvx validate --check`: the side channel's address binds on this machine, the
        shared secret reads (at least 8 characters)."""
        import kvx

        problems = []
        try:
            kvx.resolve_secret(self.shared_secret, "shared_secret", min_length=MIN_SECRET_LENGTH)
        except ConfigError as exc:
            problems += exc.problems
        address = side_channel_address(self)
        key = "side_channel_port" if address.port else "side_channel_host"
        problem = bind_problem(address.host, address.port)
        if problem is not None:
            problems.append(ConfigProblem(key, problem))
        return problems


class NixlPushConfig(NixlConfig, forbid_unknown_fields=True):
    """NixlConfig with `transfer_mode` "push" by default (the `NixlPushConnector` name)."""

    transfer_mode: Literal["pull", "push"] = "push"


def bind_problem(host: str, port: int) -> str | None:
    """Why a TCP listener cannot bind `host:port` here (None if it can; the test socket is
    closed at once)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((host, port))
        except OSError as exc:
            return (
                f"cannot listen on {host}:{port}: {exc.strerror or exc}; pick a free port (0: "
                "any) and an address of this machine"
            )
    return None


def split_address(text: str) -> tuple[str, int]:
    """`host:port` (IPv6 as `[addr]:port`) -> (host, port); `localhost` is 127.0.0.1. Raises
    ValueError naming what is wrong."""
    host, sep, port = text.rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not sep or not host or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise ValueError(
            f"{text[:100]!r} is not host:port of a P side channel (port 1-65535), e.g. "
            "'127.0.0.1:5600'"
        )
    return ("127.0.0.1" if host == "localhost" else host), int(port)


def host_problem(host: str) -> str | None:
    """Why `host` cannot be a side-channel address (None if it can): an IP address or
    "localhost" (vLLM's default, the same as 127.0.0.1)."""
    if host == "localhost":
        return None
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return (
            f"{host[:100]!r} is not an IP address; use e.g. '127.0.0.1' or 'localhost' (this "
            "machine only) or the address of an interface"
        )
    return None


@dataclass(frozen=True)
class SideChannelAddress:
    """Where P serves handshakes, and where each part came from ("config", the environment
    variable's name, or "default")."""

    host: str
    port: int
    host_from: str
    port_from: str


def side_channel_address(
    options: NixlConfig, environ: Mapping[str, str] | None = None
) -> SideChannelAddress:
    """The side channel's address: the config's keys, else vLLM's environment variables, else
    127.0.0.1 and a free port. Raises `ConfigError` naming the variable for a bad value."""
    env = os.environ if environ is None else environ
    host, host_from = options.side_channel_host, "config"
    if host is None:
        host, host_from = env.get(HOST_ENV), HOST_ENV
        if host is None:
            host, host_from = DEFAULT_HOST, "default"
        elif (problem := host_problem(host)) is not None:
            raise ConfigError(
                [
                    ConfigProblem(
                        "kv_connector_extra_config.side_channel_host", f"{HOST_ENV}={problem}"
                    )
                ]
            )
    port, port_from = options.side_channel_port, "config"
    if port is None:
        text, port_from = env.get(PORT_ENV), PORT_ENV
        if text is None:
            port, port_from = 0, "default"
        elif text.strip().isdigit() and int(text) <= 65535:
            port = int(text)
        else:
            raise ConfigError(
                [
                    ConfigProblem(
                        "kv_connector_extra_config.side_channel_port",
                        f"{PORT_ENV}={text[:40]!r} is not a port; use 0-65535 (0: a free port)",
                    )
                ]
            )
    return SideChannelAddress(
        DEFAULT_HOST if host == "localhost" else host, port, host_from, port_from
    )


def check_groups_supported(options: NixlConfig, groups: int) -> None:
    """Several KV-cache groups are read in pull mode only, without `verify_transfers`."""
    if groups == 1:
        return
    for name, value, allowed in (
        ("transfer_mode", options.transfer_mode, "pull"),
        ("verify_transfers", options.verify_transfers, False),
    ):
        if value != allowed:
            raise ValueError(
                f"NixlConnector: {name}={value!r} is not supported with {groups} KV-cache "
                f"groups (vLLM's hybrid allocator); use {name}={allowed!r} or turn the "
                "allocator off (--disable-hybrid-kv-cache-manager)"
            )
