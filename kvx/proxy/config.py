"""The proxy's settings, checked once: every problem names the flag, the value and what is allowed.

Pure Python (no third-party imports), so `kvx proxy --help` and flag errors work without the
`proxy` extra installed.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from kvx.errors import ConfigError, ConfigProblem, did_you_mean, quote, quoted_list

ROUTING_POLICIES = ("round_robin", "least_outstanding", "kv_aware")
"""How the proxy picks among the servers of one role (see `kvx.proxy.routing`)."""

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8000
DEFAULT_MAX_BODY_BYTES = 10 * 1024 * 1024
MAX_BODY_BYTES_LIMIT = 1024 * 1024 * 1024
"""The largest --max-body-bytes accepted: a client body is held in memory whole."""
DEFAULT_MAX_BODY_MEMORY = 64 * 1024 * 1024
BODY_COPIES = 4
"""How many times over a request's body is held while it is served (as received, parsed,
encoded for P, encoded for D): what it counts against --max-body-memory."""
MAX_CONNECTIONS_LIMIT = 1 << 20
MAX_KV_INDEX_BLOCKS = 10_000_000
KV_EVENT_SCHEMES = ("tcp://", "ipc://")


class ProxySettingError(ConfigError):
    """A proxy setting was rejected; `problems` names each flag, its value and what is allowed."""

    def _render(self) -> str:
        if len(self.problems) == 1:
            return f"invalid proxy setting: {self.problems[0]}"
        return "\n".join(
            [f"invalid proxy settings ({len(self.problems)} problems):"]
            + [f"  - {p}" for p in self.problems]
        )


def normalize_server_url(url: str) -> str:
    """`http(s)://HOST[:PORT]` with no trailing slash; ValueError says what is wrong."""
    if not isinstance(url, str) or not url.strip():
        raise ValueError("expected a server URL such as http://127.0.0.1:8100")
    parts = urlsplit(url.strip())
    if parts.scheme not in ("http", "https"):
        raise ValueError("expected http://HOST:PORT or https://HOST:PORT")
    try:
        port = parts.port
    except ValueError:
        raise ValueError("the port must be an integer in 1-65535") from None
    if not parts.hostname:
        raise ValueError("the URL names no host; expected http://HOST:PORT")
    if port == 0:
        raise ValueError("the port must be an integer in 1-65535")
    if parts.username is not None or parts.query or parts.fragment:
        raise ValueError("expected http://HOST:PORT without credentials, query or fragment")
    if parts.path not in ("", "/"):
        raise ValueError(
            f"expected the server's root URL without a path (the proxy adds /v1/...), "
            f"got path {parts.path!r}"
        )
    return f"{parts.scheme}://{parts.netloc}"


def _positive_seconds(flag: str, value: float, problems: list[ConfigProblem]) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        problems.append(ConfigProblem(flag, f"{quote(value)} is not a number of seconds"))
    elif not (math.isfinite(value) and value > 0):
        problems.append(ConfigProblem(flag, f"{quote(value)} is not allowed; expected seconds > 0"))


def _server_problems(flag: str, urls: Iterable[str], problems: list[ConfigProblem]) -> None:
    seen: set[str] = set()
    for url in urls:
        try:
            normal = normalize_server_url(url)
        except ValueError as exc:
            problems.append(ConfigProblem(flag, f"{quote(url)}: {exc}"))
            continue
        if normal in seen:
            problems.append(ConfigProblem(flag, f"{quote(url)} is given twice"))
        seen.add(normal)


def parse_kv_events(entry: str) -> tuple[str, str]:
    """`SERVER_URL=ENDPOINT` as (normalized URL, endpoint); ValueError says what is wrong."""
    if not isinstance(entry, str) or "=" not in entry:
        raise ValueError(
            "expected SERVER_URL=ENDPOINT, e.g. http://127.0.0.1:8100=tcp://127.0.0.1:5557"
        )
    url, endpoint = entry.split("=", 1)
    url = normalize_server_url(url)
    if not endpoint.startswith(KV_EVENT_SCHEMES) or len(endpoint) <= 6 or len(endpoint) > 300:
        raise ValueError(
            f"the endpoint {endpoint!r} must be tcp://HOST:PORT or ipc://PATH (at most 300 "
            "characters), where the server's vLLM publishes its KV events"
        )
    return url, endpoint


def _kv_aware_problems(config: ProxyConfig, problems: list[ConfigProblem]) -> None:
    seen: set[str] = set()
    for entry in config.kv_events:
        try:
            url, _ = parse_kv_events(entry)
        except ValueError as exc:
            problems.append(ConfigProblem("--kv-events", f"{quote(entry)}: {exc}"))
            continue
        if url in seen:
            problems.append(ConfigProblem("--kv-events", f"{quote(entry)}: {url} is given twice"))
        seen.add(url)
    if config.routing == "kv_aware" and not config.kv_events:
        problems.append(
            ConfigProblem(
                "--kv-events",
                "--routing kv_aware needs at least one SERVER_URL=ENDPOINT (where a server's "
                "KV events are published)",
            )
        )
    if config.kv_events and config.routing != "kv_aware":
        problems.append(
            ConfigProblem(
                "--kv-events", f"is only used with --routing kv_aware, not {config.routing}"
            )
        )
    _int_in("--kv-index-blocks", config.kv_index_blocks, 1, MAX_KV_INDEX_BLOCKS, problems)


def _int_in(flag: str, value: object, low: int, high: int, problems: list[ConfigProblem]) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        problems.append(
            ConfigProblem(
                flag, f"{quote(value)} is not allowed; expected an integer in {low}-{high}"
            )
        )


def _discovery_problems(config: ProxyConfig, problems: list[ConfigProblem]) -> None:
    if config.discovery_port is None:
        return
    _int_in("--discovery-port", config.discovery_port, 0, 65535, problems)
    host = config.discovery_host
    if not isinstance(host, str) or not host.strip() or any(c.isspace() for c in host):
        problems.append(ConfigProblem("--discovery-host", f"{quote(host)} is not a host name"))
    _positive_seconds("--discovery-timeout", config.discovery_timeout, problems)
    _int_in("--discovery-max-servers", config.discovery_max_servers, 1, 4096, problems)
    secret = config.discovery_secret
    if secret is not None and (not isinstance(secret, str) or len(secret) < 8):
        problems.append(
            ConfigProblem(
                "--discovery-secret-file",
                "the secret must be a text of at least 8 characters (leading and trailing "
                "white space is ignored)",
            )
        )


@dataclass(frozen=True)
class ProxyConfig:
    """Everything `kvx proxy` is told. Invalid values raise `ProxySettingError` naming the
    flag (`--request-timeout`, ...), the value and what is allowed.

    `prefill` and `decode` may be empty in the Python API (servers can be added at run time
    through `ServerPool.add`); the CLI requires at least one of each unless discovery is on
    (`discovery_port`).
    """

    prefill: tuple[str, ...] = ()
    decode: tuple[str, ...] = ()
    host: str = DEFAULT_HOST
    port: int = DEFAULT_PORT
    routing: str = "round_robin"
    health_interval: float = 2.0
    """Seconds between two rounds of GET /health on every server."""
    health_timeout: float = 5.0
    """Seconds a server has to answer GET /health before it counts as down."""
    request_timeout: float = 300.0
    """Seconds an upstream server has to connect, answer, and send each next chunk of a stream;
    a non-streamed answer must arrive whole within it."""
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    max_body_memory: int = DEFAULT_MAX_BODY_MEMORY
    """Bytes request bodies may hold at once, over all requests, each counting BODY_COPIES
    times its size; a body that does not fit gets a 503 (at least BODY_COPIES x
    `max_body_bytes`)."""
    header_timeout: float = 10.0
    """Seconds a client connection has to send its request's headers."""
    body_timeout: float = 60.0
    """Seconds a client has to send its whole request body once its headers are in."""
    max_connections: int = 1024
    """Open client connections; past it the one waiting longest for its headers is closed
    (lowered to a third of the process's descriptor limit)."""
    max_concurrent_requests: int = 256
    """Requests served at once; more get a 503 at once."""
    discovery_port: int | None = None
    """Listen for P and D servers announcing themselves on this port (0: a free one); None:
    no discovery (`kvx.proxy.discovery`)."""
    discovery_host: str = DEFAULT_HOST
    discovery_timeout: float = 10.0
    """Seconds after its last heartbeat a discovered server leaves the rotation."""
    discovery_max_servers: int = 256
    discovery_secret: str | None = field(default=None, repr=False)
    """Announcements must be sealed with it (HMAC-SHA256); None: any is accepted."""
    kv_events: tuple[str, ...] = ()
    """`SERVER_URL=ENDPOINT`: where a server's engine publishes its KV events (kv_aware)."""
    kv_index_blocks: int = 100_000
    """Blocks the prefix index keeps per server (kv_aware), the least recently stored go."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "prefill", tuple(self.prefill))
        object.__setattr__(self, "decode", tuple(self.decode))
        problems: list[ConfigProblem] = []
        _server_problems("--prefill", self.prefill, problems)
        _server_problems("--decode", self.decode, problems)
        if not isinstance(self.host, str) or not self.host.strip():
            problems.append(ConfigProblem("--host", f"{quote(self.host)} is not a host name"))
        if (
            isinstance(self.port, bool)
            or not isinstance(self.port, int)
            or not 0 <= self.port <= 65535
        ):
            problems.append(
                ConfigProblem(
                    "--port", f"{quote(self.port)} is not allowed; expected an integer in 0-65535"
                )
            )
        if self.routing not in ROUTING_POLICIES:
            problems.append(
                ConfigProblem(
                    "--routing",
                    f"{quote(self.routing)} is not a routing policy; allowed: "
                    f"{quoted_list(ROUTING_POLICIES)}"
                    f"{did_you_mean(str(self.routing), ROUTING_POLICIES)}",
                )
            )
        _positive_seconds("--health-interval", self.health_interval, problems)
        _positive_seconds("--health-timeout", self.health_timeout, problems)
        _positive_seconds("--request-timeout", self.request_timeout, problems)
        if (
            isinstance(self.max_body_bytes, bool)
            or not isinstance(self.max_body_bytes, int)
            or not 1 <= self.max_body_bytes <= MAX_BODY_BYTES_LIMIT
        ):
            problems.append(
                ConfigProblem(
                    "--max-body-bytes",
                    f"{quote(self.max_body_bytes)} is not allowed; expected an integer in "
                    f"1-{MAX_BODY_BYTES_LIMIT}",
                )
            )
        _positive_seconds("--header-timeout", self.header_timeout, problems)
        _positive_seconds("--body-timeout", self.body_timeout, problems)
        _int_in("--max-connections", self.max_connections, 1, MAX_CONNECTIONS_LIMIT, problems)
        _int_in(
            "--max-concurrent-requests",
            self.max_concurrent_requests,
            1,
            MAX_CONNECTIONS_LIMIT,
            problems,
        )
        if isinstance(self.max_body_bytes, int) and not isinstance(self.max_body_bytes, bool):
            _int_in(
                "--max-body-memory",
                self.max_body_memory,
                max(1, self.max_body_bytes) * BODY_COPIES,
                64 * MAX_BODY_BYTES_LIMIT,
                problems,
            )
        _discovery_problems(self, problems)
        object.__setattr__(self, "kv_events", tuple(self.kv_events))
        _kv_aware_problems(self, problems)
        if problems:
            raise ProxySettingError(problems)
        object.__setattr__(self, "prefill", tuple(normalize_server_url(u) for u in self.prefill))
        object.__setattr__(self, "decode", tuple(normalize_server_url(u) for u in self.decode))

    def kv_event_sources(self) -> list[tuple[str, str]]:
        """(server URL, endpoint) of each --kv-events."""
        return [parse_kv_events(entry) for entry in self.kv_events]
