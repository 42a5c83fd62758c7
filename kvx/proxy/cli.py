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

from kvx.errors import ConfigProblem, quote
from kvx.proxy.config import (
    DEFAULT_HOST,
    DEFAULT_MAX_BODY_BYTES,
    DEFAULT_PORT,
    ROUTING_POLICIES,
    ProxyConfig,
    ProxySettingError,
)

EXTRA_MODULES = ("starlette", "httpx", "uvicorn")
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


def _number(
    flag: str, text: str, kind: type[int] | type[float], problems: list[ConfigProblem]
) -> Any:
    try:
        return kind(text)
    except ValueError:
        noun = "an integer" if kind is int else "a number of seconds"
        problems.append(ConfigProblem(flag, f"{quote(text)} is not {noun}"))
        return None


def config_from_args(args: argparse.Namespace) -> ProxyConfig:
    """The settings the flags give; ProxySettingError lists every bad flag at once."""
    problems: list[ConfigProblem] = []
    for flag, urls in (("--prefill", args.prefill), ("--decode", args.decode)):
        if not urls:
            problems.append(
                ConfigProblem(flag, f"at least one server URL is required (repeat {flag} for more)")
            )
    numbers = {
        "port": _number("--port", args.port, int, problems),
        "health_interval": _number("--health-interval", args.health_interval, float, problems),
        "health_timeout": _number("--health-timeout", args.health_timeout, float, problems),
        "request_timeout": _number("--request-timeout", args.request_timeout, float, problems),
        "max_body_bytes": _number("--max-body-bytes", args.max_body_bytes, int, problems),
    }
    try:
        config = ProxyConfig(
            prefill=tuple(args.prefill),
            decode=tuple(args.decode),
            host=args.host,
            routing=args.routing,
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

    def announce(url: str) -> None:
        out.print(
            f"kvx proxy listening on {url} (routing {config.routing}; "
            f"prefill: {', '.join(config.prefill)}; decode: {', '.join(config.decode)})",
            markup=False,
            highlight=False,
        )
        sys.stdout.flush()

    serve(config, on_listening=announce)
    return 0
