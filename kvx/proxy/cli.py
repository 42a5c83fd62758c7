"""`kvx proxy` on the command line: its flags, their checks, and running the server.

Imports nothing of the `proxy` extra until the proxy starts, so flag errors and `--help` work
without it.
"""

from __future__ import annotations

import argparse
import importlib.util
import logging
import sys
from typing import Any

from rich.console import Console

from kvx import tracing
from kvx.discovery import DEFAULT_DISCOVERY_PORT
from kvx.errors import ConfigProblem, MissingDependencyError, quote
from kvx.proxy.config import (
    DEFAULT_HOST,
    DEFAULT_MAX_BODY_BYTES,
    DEFAULT_PORT,
    ROUTING_POLICIES,
    ProxyConfig,
    ProxySettingError,
)

EXTRA_MODULES = ("starlette", "httpx", "uvicorn", "prometheus_client")
_DEFAULTS = ProxyConfig()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of `kvx proxy`. Numbers are taken as text and checked by `config_from_args`,
    so a bad one is reported with what is allowed."""
    parser.add_argument(
        "--prefill",
        action="append",
        default=[],
        metavar="URL",
        help="a prefill server, http://HOST:PORT (repeat for more)",
    )
    parser.add_argument(
        "--decode",
        action="append",
        default=[],
        metavar="URL",
        help="a decode server, http://HOST:PORT (repeat for more)",
    )
    parser.add_argument(
        "--host", default=DEFAULT_HOST, help=f"address to listen on (default {DEFAULT_HOST})"
    )
    parser.add_argument(
        "--port",
        default=str(DEFAULT_PORT),
        help=f"port to listen on, 0 for a free one (default {DEFAULT_PORT})",
    )
    parser.add_argument(
        "--routing",
        default=_DEFAULTS.routing,
        metavar="|".join(ROUTING_POLICIES),
        help=f"how to choose among servers of one role (default {_DEFAULTS.routing})",
    )
    parser.add_argument(
        "--kv-events",
        action="append",
        default=[],
        metavar="URL=ENDPOINT",
        help="with --routing kv_aware: where a server's KV events are published, e.g. "
        "http://127.0.0.1:8100=tcp://127.0.0.1:5557 (repeat per server)",
    )
    parser.add_argument(
        "--kv-index-blocks",
        default=str(_DEFAULTS.kv_index_blocks),
        metavar="N",
        help=f"blocks the prefix index keeps per server (default {_DEFAULTS.kv_index_blocks})",
    )
    parser.add_argument(
        "--health-interval",
        default=str(_DEFAULTS.health_interval),
        metavar="S",
        help=f"seconds between health checks (default {_DEFAULTS.health_interval:g})",
    )
    parser.add_argument(
        "--health-timeout",
        default=str(_DEFAULTS.health_timeout),
        metavar="S",
        help=f"seconds a server has to answer GET /health (default {_DEFAULTS.health_timeout:g})",
    )
    parser.add_argument(
        "--request-timeout",
        default=str(_DEFAULTS.request_timeout),
        metavar="S",
        help="seconds an upstream server has to answer, and between two chunks of a stream "
        f"(default {_DEFAULTS.request_timeout:g})",
    )
    parser.add_argument(
        "--max-body-bytes",
        default=str(DEFAULT_MAX_BODY_BYTES),
        metavar="N",
        help=f"largest request body accepted (default {DEFAULT_MAX_BODY_BYTES})",
    )
    parser.add_argument(
        "--max-body-memory",
        default=str(_DEFAULTS.max_body_memory),
        metavar="N",
        help="bytes of request bodies held at once over all requests; more get a 503 "
        f"(default {_DEFAULTS.max_body_memory})",
    )
    parser.add_argument(
        "--header-timeout",
        default=str(_DEFAULTS.header_timeout),
        metavar="S",
        help="seconds a client connection has to send its request headers "
        f"(default {_DEFAULTS.header_timeout:g})",
    )
    parser.add_argument(
        "--body-timeout",
        default=str(_DEFAULTS.body_timeout),
        metavar="S",
        help=f"seconds a client has to send its request body (default {_DEFAULTS.body_timeout:g})",
    )
    parser.add_argument(
        "--max-connections",
        default=str(_DEFAULTS.max_connections),
        metavar="N",
        help="open client connections; past it the one idle longest is closed "
        f"(default {_DEFAULTS.max_connections}, at most a third of the descriptor limit)",
    )
    parser.add_argument(
        "--max-concurrent-requests",
        default=str(_DEFAULTS.max_concurrent_requests),
        metavar="N",
        help="requests served at once; more get a 503 "
        f"(default {_DEFAULTS.max_concurrent_requests})",
    )
    parser.add_argument(
        "--discovery-port",
        default=None,
        metavar="PORT",
        help="listen here for P and D servers announcing themselves by heartbeat "
        f"(ZMQ; {DEFAULT_DISCOVERY_PORT} in vLLM's example, 0 for a free one; default: off)",
    )
    parser.add_argument(
        "--discovery-host",
        default=DEFAULT_HOST,
        metavar="HOST",
        help=f"address the discovery listener binds (default {DEFAULT_HOST})",
    )
    parser.add_argument(
        "--discovery-timeout",
        default=str(_DEFAULTS.discovery_timeout),
        metavar="S",
        help="seconds after its last heartbeat a discovered server leaves the rotation "
        f"(default {_DEFAULTS.discovery_timeout:g})",
    )
    parser.add_argument(
        "--discovery-max-servers",
        default=str(_DEFAULTS.discovery_max_servers),
        metavar="N",
        help="most discovered servers in rotation at once "
        f"(default {_DEFAULTS.discovery_max_servers})",
    )
    parser.add_argument(
        "--discovery-secret-file",
        default=None,
        metavar="PATH",
        help="a file holding the shared secret announcements must be sealed with "
        "(default: none, any announcement is accepted)",
    )


def _number(
    flag: str, text: str, kind: type[int] | type[float], problems: list[ConfigProblem]
) -> Any:
    try:
        return kind(text)
    except ValueError:
        noun = "an integer" if kind is int else "a number of seconds"
        problems.append(ConfigProblem(flag, f"{quote(text)} is not {noun}"))
        return None


def _secret(path: str | None, problems: list[ConfigProblem]) -> str | None:
    if path is None:
        return None
    try:
        with open(path, encoding="utf-8") as file:
            return file.read(4096).strip()
    except (OSError, UnicodeDecodeError) as exc:
        problems.append(ConfigProblem("--discovery-secret-file", f"{quote(path)}: {exc}"))
        return None


def config_from_args(args: argparse.Namespace) -> ProxyConfig:
    """The settings the flags give; ProxySettingError lists every bad flag at once."""
    problems: list[ConfigProblem] = []
    for flag, urls in (("--prefill", args.prefill), ("--decode", args.decode)):
        if not urls and args.discovery_port is None:
            problems.append(
                ConfigProblem(
                    flag,
                    f"at least one server URL is required (repeat {flag} for more), or "
                    "--discovery-port for servers that announce themselves",
                )
            )
    numbers = {
        "port": _number("--port", args.port, int, problems),
        "health_interval": _number("--health-interval", args.health_interval, float, problems),
        "health_timeout": _number("--health-timeout", args.health_timeout, float, problems),
        "request_timeout": _number("--request-timeout", args.request_timeout, float, problems),
        "max_body_bytes": _number("--max-body-bytes", args.max_body_bytes, int, problems),
        "max_body_memory": _number("--max-body-memory", args.max_body_memory, int, problems),
        "header_timeout": _number("--header-timeout", args.header_timeout, float, problems),
        "body_timeout": _number("--body-timeout", args.body_timeout, float, problems),
        "max_connections": _number("--max-connections", args.max_connections, int, problems),
        "max_concurrent_requests": _number(
            "--max-concurrent-requests", args.max_concurrent_requests, int, problems
        ),
        "kv_index_blocks": _number("--kv-index-blocks", args.kv_index_blocks, int, problems),
    }
    if args.discovery_port is not None:
        numbers |= {
            "discovery_port": _number("--discovery-port", args.discovery_port, int, problems),
            "discovery_timeout": _number(
                "--discovery-timeout", args.discovery_timeout, float, problems
            ),
            "discovery_max_servers": _number(
                "--discovery-max-servers", args.discovery_max_servers, int, problems
            ),
            "discovery_secret": _secret(args.discovery_secret_file, problems),
        }
    try:
        config = ProxyConfig(
            prefill=tuple(args.prefill),
            decode=tuple(args.decode),
            host=args.host,
            routing=args.routing,
            kv_events=tuple(args.kv_events),
            discovery_host=args.discovery_host,
            **{name: value for name, value in numbers.items() if value is not None},
        )
    except ProxySettingError as exc:
        raise ProxySettingError([*problems, *exc.problems]) from None
    if problems:
        raise ProxySettingError(problems)
    return config


def missing_extra() -> list[str]:
    """The modules of the `proxy` extra that are not installed."""
    return [m for m in EXTRA_MODULES if importlib.util.find_spec(m) is None]


def run(config: ProxyConfig, out: Console) -> int:
    """Serve until SIGINT/SIGTERM; the first line on stdout says where it listens."""
    from kvx.proxy.server import serve

    if not logging.getLogger().handlers:
        logging.basicConfig(
            level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
        )
    logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per upstream request
    try:
        tracing.setup_from_env()
    except (ValueError, MissingDependencyError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2

    def announce(url: str, discovery: str | None) -> None:
        found = f"; discovery on {discovery}" if discovery else ""
        out.print(
            f"kvx proxy listening on {url} (routing {config.routing}; "
            f"prefill: {', '.join(config.prefill) or '-'}; "
            f"decode: {', '.join(config.decode) or '-'}{found})",
            markup=False,
            highlight=False,
        )
        sys.stdout.flush()

    serve(config, on_listening=announce)
    return 0
