"""YAML config files (`@kv.yaml`): parsed with `yaml.safe_load`, then held to JSON's data model
so the same validation applies as for a JSON config.

YAML-only values (dates and timestamps, `!!binary`, `!!set`, `!!omap`, non-string keys, NaN and
infinities) are refused with the path of the value, and aliases cannot expand a small file into
a large value: the converted value may hold at most `MAX_YAML_VALUES` values.
"""

from __future__ import annotations

import datetime
import math
from typing import Any

from kvx.config.schema import join_path
from kvx.errors import ConfigError, ConfigProblem

MAX_YAML_VALUES = 100_000
YAML_SUFFIXES = (".yaml", ".yml")

_REFUSED: tuple[tuple[type, str], ...] = (
    (datetime.date, "a YAML date or timestamp"),  # datetime.datetime is a date too
    (bytes, "YAML binary data (!!binary)"),
    (set, "a YAML set (!!set)"),
    (tuple, "a YAML ordered map or pair (!!omap, !!pairs)"),
)


def parse_yaml(text: str, source: str, max_depth: int) -> Any:
    """The JSON-model value of YAML `text` from file `source`; a `ConfigError` names the file,
    and the line and column of a syntax error."""
    import yaml  # imported here: JSON configs and `kvx --help` do not pay for it

    try:
        value = yaml.safe_load(text)
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        where = f" at line {mark.line + 1} column {mark.column + 1}" if mark else ""
        what = exc.problem or exc.context or "syntax error"
        raise _error("", f"config file {source!r} is not valid YAML: {what}{where}") from None
    except (yaml.YAMLError, RecursionError) as exc:
        raise _error("", f"config file {source!r} is not valid YAML: {exc}") from None
    return _json_value(value, source, max_depth)


def _json_value(value: Any, source: str, max_depth: int) -> Any:
    """`value` rebuilt from JSON's types only (aliases become copies), or a `ConfigError`."""
    budget = [MAX_YAML_VALUES]

    def convert(item: Any, path: str, depth: int) -> Any:
        budget[0] -= 1
        if budget[0] < 0:
            raise _error(
                "", f"config file {source!r} expands to more than {MAX_YAML_VALUES} values"
            )
        if isinstance(item, dict | list) and depth > max_depth:
            raise _error(path, f"nested deeper than {max_depth} levels of objects and arrays")
        if isinstance(item, dict):
            out = {}
            for key, child in item.items():
                if not isinstance(key, str):
                    raise _error(
                        path,
                        f"key {key!r} ({type(key).__name__}) in {source!r} is not allowed: "
                        "keys must be strings (quote it)",
                    )
                out[key] = convert(child, join_path(path, key), depth + 1)
            return out
        if isinstance(item, list):
            return [convert(child, join_path(path, i), depth + 1) for i, child in enumerate(item)]
        if isinstance(item, float) and not math.isfinite(item):
            raise _error(path, f"{item!r} in {source!r} is not allowed: use a finite number")
        if item is None or isinstance(item, str | int | float):
            return item
        for kind, name in _REFUSED:
            if isinstance(item, kind):
                raise _error(
                    path,
                    f"{name} ({str(item)[:40]!r}) in {source!r} is not allowed: a config holds "
                    "only strings, numbers, booleans, null, lists and mappings (quote it to "
                    "make it a string)",
                )
        raise _error(path, f"a {type(item).__name__} in {source!r} is not allowed")

    return convert(value, "", 1)


def _error(path: str, message: str) -> ConfigError:
    return ConfigError([ConfigProblem(path, message)])
