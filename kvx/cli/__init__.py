"""The CLI operator's wing: the `kvx` command line.

Modules:

- `commands`: the parser, `kvx validate` / `demo` / `tiny-model` / `completion` / `proxy`, plugins'
  subcommands, `main(argv)` and the console script's `run()`
- `listing`: `kvx list`'s tables and JSON
- `checks`: what `kvx validate` adds to a valid config (notes, secret redaction, `--check`)
- `completion`: shell completion scripts generated from the parser
- `demo`: `kvx demo`, prefill and decode engines in separate processes
"""

from __future__ import annotations

from kvx.cli.commands import main, run

__all__ = ["main", "run"]
