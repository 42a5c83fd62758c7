"""vLLM's dot notation for a JSON argument: `--kv-transfer-config.kv_role=kv_both`,
`--kv-transfer-config.kv_connector_extra_config.storage_url file:///var/kv`.

Each `--kv-transfer-config.KEY[.KEY...] VALUE` (or `=VALUE`) sets one key of the config,
nested objects made as needed, over the `--kv-transfer-config` JSON if one is given too. A value
that parses as JSON (`8`, `true`, `{"a": 1}`) is that JSON value; any other text is a string.
`merge_dotted_args` rewrites a command line into one `--kv-transfer-config JSON` argument, so
every command that takes the flag takes the dot notation too.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from kvx.config.transfer import load_cli_arg
from kvx.errors import ConfigError, ConfigProblem

FLAG = "--kv-transfer-config"


def merge_dotted_args(argv: Sequence[str]) -> list[str]:
    """`argv` with every `--kv-transfer-config.KEY VALUE` merged into one
    `--kv-transfer-config JSON` (unchanged when there is none). Raises `ConfigError` naming
    the key for a dotted flag without a value or one that contradicts another."""
    rest: list[str] = []
    assignments: list[tuple[str, str]] = []
    base: str | None = None
    args = list(argv)
    i = 0
    while i < len(args):
        arg = args[i]
        if arg == "--":
            rest += args[i:]
            break
        if arg.startswith(FLAG + "."):
            key, sep, value = arg[len(FLAG) + 1 :].partition("=")
            if not sep:
                if i + 1 >= len(args) or args[i + 1].startswith("--"):
                    raise _problem(key, f"{arg} is given without a value; use {FLAG}.{key}=VALUE")
                value = args[i + 1]
                i += 1
            assignments.append((key, value))
        elif arg == FLAG and i + 1 < len(args):
            base = args[i + 1]
            i += 1
        elif arg.startswith(FLAG + "="):
            base = arg[len(FLAG) + 1 :]
        else:
            rest.append(arg)
        i += 1
    if not assignments:
        return list(argv)
    config = load_cli_arg(base) if base is not None else {}
    if not isinstance(config, dict):
        return list(argv)  # the JSON's own type error is reported where it is parsed
    for key, value in assignments:
        _assign(config, key, _value(value))
    at = _command_end(rest)
    return [*rest[:at], FLAG, json.dumps(config), *rest[at:]]


def _command_end(args: list[str]) -> int:
    """Where to put the merged flag: before a `--` that ends the options, else at the end."""
    return args.index("--") if "--" in args else len(args)


def _value(text: str) -> Any:
    """A dotted flag's value: its JSON value when it is JSON (no NaN/Infinity), else the text."""

    def no_constants(name: str) -> Any:
        raise ValueError(name)

    try:
        return json.loads(text, parse_constant=no_constants)
    except ValueError:
        return text


def _assign(config: dict[str, Any], key: str, value: Any) -> None:
    parts = key.split(".")
    if any(not part for part in parts):
        raise _problem(
            key,
            f"{FLAG}.{key}: empty key name; use {FLAG}.KEY or {FLAG}.kv_connector_extra_config.KEY",
        )
    node = config
    for depth, part in enumerate(parts[:-1]):
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            where = ".".join(parts[: depth + 1])
            raise _problem(
                where,
                f"is {json.dumps(child)[:60]}, not an object, so {FLAG}.{key} cannot set a "
                "key inside it",
            )
        node = child
    node[parts[-1]] = value


def _problem(path: str, message: str) -> ConfigError:
    return ConfigError([ConfigProblem(path, message)])
