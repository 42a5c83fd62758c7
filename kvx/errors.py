"""Errors kvx raises for bad input: each names where, what was given and what is allowed."""

from __future__ import annotations

import difflib
import json
from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True)
class ConfigProblem:
    """One thing wrong with a config, at a dotted path such as
    `kv_connector_extra_config.connectors[1].kv_role`."""

    path: str
    message: str

    def __str__(self) -> str:
        text = f"{self.path or '<config>'}: {self.message}"
        # a lone surrogate (a key or value given as "\ud800") shown escaped: it cannot be printed
        return text.encode("utf-8", "backslashreplace").decode("utf-8")


class ConfigError(ValueError):
    """A configuration was rejected; `problems` lists every reason found."""

    def __init__(self, problems: Iterable[ConfigProblem]) -> None:
        self.problems = list(problems)
        super().__init__(self._render())

    def _render(self) -> str:
        if len(self.problems) == 1:
            return f"invalid KV transfer config: {self.problems[0]}"
        lines = [f"invalid KV transfer config ({len(self.problems)} problems):"]
        lines += [f"  - {p}" for p in self.problems]
        return "\n".join(lines)


class RegistryError(LookupError):
    """A plugin, connector, layout or backend could not be found, loaded or registered."""


class MissingDependencyError(RegistryError, ImportError):
    """A plugin needs an optional dependency that is not installed; the message says how."""


def quote(value: object) -> str:
    """A value as it would appear in JSON (`"kv_both"`, `3`, `null`)."""
    try:
        return json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError):
        return repr(value)
    except RecursionError:  # repr would recurse as deep
        return f"<{type(value).__name__} nested too deep to show>"


def did_you_mean(word: str, choices: Iterable[str]) -> str:
    """` (did you mean "x"?)` for the closest choice, or an empty string."""
    close = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    if not close:
        lowered = {c.lower(): c for c in choices}
        if word.lower() in lowered:
            close = [lowered[word.lower()]]
    return f" (did you mean {quote(close[0])}?)" if close else ""


def quoted_list(items: Iterable[object]) -> str:
    """`"a", "b", "c"` for a message."""
    return ", ".join(quote(i) for i in items)
