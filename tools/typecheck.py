"""Run mypy over kvx with every module under its import name (`make typecheck`).

`pyproject.toml` installs the folders `plugins/`, `layouts/` and `conformance/` as `kvx.plugins`,
`kvx.layouts` and `kvx.conformance` ([tool.setuptools.package-dir]). mypy names a file after its
folders (`plugins/storage/worker.py` would be `plugins.storage.worker`) and has no option to map a
folder to another package name, so plain `mypy` cannot resolve `from kvx.plugins... import`.
This script lets mypy collect the files of [tool.mypy] as usual, renames each by the same
package-dir table setuptools uses, and runs mypy's build on the renamed sources: errors name the
real files, and every import between kvx's parts resolves to checked code.

Usage: `python tools/typecheck.py [mypy options] [files]`; `MODULE=PATH` arguments add a file
under a chosen module name (tests use it to check a probe as if it lived inside a plugin).
"""

from __future__ import annotations

import sys
import time
import tomllib
from pathlib import Path

from mypy import build, util
from mypy.errors import CompileError
from mypy.fscache import FileSystemCache
from mypy.main import process_options
from mypy.modulefinder import BuildSource

ROOT = Path(__file__).resolve().parent.parent


def package_dirs() -> dict[Path, str]:
    """Folder -> package name, from pyproject's [tool.setuptools.package-dir]."""
    with open(ROOT / "pyproject.toml", "rb") as f:
        table = tomllib.load(f)["tool"]["setuptools"]["package-dir"]
    return {(ROOT / folder).resolve(): package for package, folder in table.items()}


def import_name(path: str, dirs: dict[Path, str]) -> str | None:
    """The module name `path` is installed as, or None if it lies outside the mapped folders."""
    file = Path(path).resolve()
    for folder, package in sorted(dirs.items(), key=lambda item: -len(item[0].parts)):
        if file.is_relative_to(folder):
            parts = [package, *file.relative_to(folder).with_suffix("").parts]
            return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
    return None


def renamed(sources: list[BuildSource], dirs: dict[Path, str]) -> list[BuildSource]:
    out = []
    for source in sources:
        module = import_name(source.path, dirs) if source.path else None
        if module is None:
            out.append(source)
        else:
            out.append(BuildSource(source.path, module, source.text, str(ROOT), source.followed))
    return out


def main(argv: list[str]) -> int:
    extra = [arg.split("=", 1) for arg in argv if "=" in arg and not arg.startswith("-")]
    args = [arg for arg in argv if not ("=" in arg and not arg.startswith("-"))]
    fscache = FileSystemCache()
    sources, options = process_options(args, fscache=fscache)
    sources = renamed(sources, package_dirs())
    sources += [BuildSource(path, module, None, str(ROOT)) for module, path in extra]
    formatter = util.FancyFormatter(sys.stdout, sys.stderr, options.hide_error_codes)
    messages: list[str] = []

    def flush(_file: str | None, new: list[str], serious: bool) -> None:
        messages.extend(new)
        for line in new:
            print(formatter.colorize(line) if options.color_output else line, flush=True)

    started = time.monotonic()
    try:
        build.build(sources, options, None, flush, fscache, sys.stdout, sys.stderr)
    except CompileError as exc:
        for line in exc.messages:
            print(line, file=sys.stderr)
        return 2
    n_errors, _notes, n_files = util.count_stats(messages)
    seconds = time.monotonic() - started
    if n_errors:
        print(f"Found {n_errors} errors in {n_files} files ({seconds:.0f}s)")
        return 1
    print(f"Success: no issues found in {len(sources)} source files ({seconds:.0f}s)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
