"""`kvx list`: every connector, layout, transform and storage backend registered, with the
plugin providing it and a status checked without importing it (`Registry.import_problem`)."""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from typing import Any

from rich.console import Console
from rich.padding import Padding
from rich.table import Table
from rich.text import Text

from kvx.registry.catalog import Registered
from kvx.registry.core import Registry, get_registry

EXIT_OK = 0


def _status(registry: Registry, kind: str, entry: Registered[Any]) -> str:
    """ "ok" only when the entry's target imports; else what stops it."""
    hint = entry.install_hint()
    if hint is not None:
        return f"missing {', '.join(entry.missing())}: {hint}"
    return registry.import_problem(kind, entry.name) or "ok"


LIST_COLUMNS = ("name", "aliases", "provided by", "status", "summary")


def _table_fits(rows: Sequence[tuple[str, ...]], width: int) -> bool:
    """Whether a `kvx list` table fits `width` without breaking a word (a name above all)."""
    columns = list(zip(LIST_COLUMNS, *rows, strict=True))
    widest_words = [max(len(word) for cell in col for word in cell.split()) for col in columns]
    return sum(widest_words) + 3 * len(columns) + 1 <= width


def _list_table(title: str, rows: Sequence[tuple[str, ...]]) -> Table:
    table = Table(title=title, title_justify="left", expand=False)
    for column in LIST_COLUMNS:
        table.add_column(column, overflow="fold")
    for row in rows:
        table.add_row(*(Text(cell) for cell in row))
    return table


def cmd_list(args: argparse.Namespace, out: Console, err: Console) -> int:
    registry = get_registry()
    kinds = {
        "connectors": "connector",
        "layouts": "layout",
        "transforms": "transform",
        "storage backends": "storage backend",
    }
    sections = {title: registry.catalogs[kind].entries for title, kind in kinds.items()}
    status = {
        (title, name): _status(registry, kinds[title], entry)
        for title, entries in sections.items()
        for name, entry in entries.items()
    }
    if args.json:
        doc: dict[str, Any] = {
            title: [
                {
                    "name": e.name,
                    "aliases": list(e.spec.aliases),
                    "source": e.source,
                    "plugin": e.plugin,
                    "importable": status[title, e.name] == "ok",
                    "status": status[title, e.name],
                    "install_hint": e.install_hint(),
                    "summary": e.spec.summary,
                }
                for e in entries.values()
            ]
            for title, entries in sections.items()
        }
        doc["plugin_problems"] = [
            {"plugin": p.plugin, "message": p.message} for p in registry.problems
        ]
        out.print_json(json.dumps(doc))
        return EXIT_OK
    for title, entries in sections.items():
        rows = [
            (e.name, ", ".join(e.spec.aliases), e.source, status[title, e.name], e.spec.summary)
            for e in sorted(entries.values(), key=lambda e: e.name)
        ]
        if _table_fits(rows, out.width):
            out.print(_list_table(f"{title} ({len(entries)})", rows))
        else:  # too narrow for whole words in five columns: one entry per paragraph
            out.print(Text(f"{title} ({len(entries)})", style="italic"))
            for name, aliases, source, state, summary in rows:
                head = Text(f"  {name}", style="bold")
                head.append(
                    f"  {state}  ({source}" + (f"; aliases: {aliases})" if aliases else ")")
                )
                out.print(head, soft_wrap=False)
                out.print(Padding(Text(summary), (0, 0, 0, 6), expand=False), soft_wrap=False)
    for problem in registry.problems:
        err.print(
            f"[yellow]warning:[/] plugin {problem.plugin!r} not loaded: {problem.message}",
            highlight=False,
        )
    return EXIT_OK
