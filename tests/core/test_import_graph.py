"""The import graph of kvx's core, read with `ast` (issue 30).

- No import cycle among `kvx/` modules: every import counts, at module level, inside a
  function or under `TYPE_CHECKING` (a cycle there is still two modules that need each other),
  and importing `a.b.c` imports the packages `a.b` and `a` too.
- Only entry points reach the process-wide registry: `get_registry()` is called in the modules
  of `ENTRY_POINTS` alone; everything below them gets the registry it works with passed in
  (`EngineContext.registry`, a `registry=` argument, `KVTransferConfig.from_dict(registry=)`).
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FOLDERS = {"kvx": "kvx", "plugins": "kvx.plugins", "layouts": "kvx.layouts"}
FOLDERS |= {"conformance": "kvx.conformance"}

ENTRY_POINTS = {
    "kvx.registry.core": "defines it; the public helpers default to it when given no registry",
    "kvx.cli.commands": "kvx list / validate / demo",
    "kvx.cli.listing": "kvx list",
    "kvx.engine.engine": "the reference Engine, built by users like vLLM's LLM",
    "kvx.adapters.vllm": "vLLM's connector factory builds the adapter",
    "kvx.adapters.vllm_config": "vLLM's config to kvx's",
    "kvx.adapters.vllm_plugin": "vLLM's general plugin",
    "kvx.conformance.cli": "kvx conformance",
    "kvx.conformance.pytest_plugin": "the conformance kit's pytest fixtures",
    "kvx.conformance.runner": "run_suite",
    "kvx.plugins.multi.connector": (
        "TODO(issue 30): class-level calls (claims_for, fault_wait_s, ...) carry no registry; "
        "MultiConnector falls back to the global one only when asked at class level without "
        "registry= (instances use ctx.registry)"
    ),
}
"""Modules allowed to call `get_registry()`, and why."""


def _modules(folder: str) -> Iterator[tuple[Path, str]]:
    base = ROOT / folder
    for path in sorted(base.rglob("*.py")):
        parts = [FOLDERS[folder], *path.relative_to(base).with_suffix("").parts]
        yield path, ".".join(p for p in parts if p != "__init__")


@cache
def _tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text(encoding="utf-8"), str(path))


def _imported(path: Path, module: str, known: set[str]) -> set[str]:
    """The modules of `known` that importing `module` (at `path`) may import, directly."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(_tree(path)):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join([*parts[: len(parts) - (node.level - 1)], *filter(None, [base])])
            names = [
                f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names
            ]
        for name in names:
            while name and name not in known:
                name = name.rpartition(".")[0]
            while name and name != module:  # the module and the packages above it
                if not module.startswith(f"{name}."):  # its own packages are already loading
                    found.add(name)
                name = name.rpartition(".")[0]
    return found


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    top = stack.pop()
                    on_stack.discard(top)
                    component.append(top)
                    if top == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def _core_graph() -> dict[str, set[str]]:
    modules = dict((name, path) for path, name in _modules("kvx"))
    known = set(modules)
    return {name: _imported(path, name, known) for name, path in modules.items()}


def test_the_cycle_finder_finds_a_cycle() -> None:
    """The check has teeth: a two-module and a three-module circle are reported."""
    graph = {"a": {"b"}, "b": {"a"}, "c": {"d"}, "d": {"e"}, "e": {"c"}, "f": {"a"}}
    assert _cycles(graph) == [["a", "b"], ["c", "d", "e"]]


def test_no_import_cycle_inside_kvx() -> None:
    graph = _core_graph()
    assert graph["kvx.config.transfer"], (
        "the graph was read (kvx.config.transfer imports kvx.config.schema)"
    )
    assert (
        "kvx.registry.core" in graph["kvx.storage.backend"]
        or "kvx.contract.types" in graph["kvx.storage.backend"]
    )
    cycles = _cycles(graph)
    shown = [
        " <-> ".join(c) + ": " + str({m: sorted(graph[m] & set(c)) for m in c}) for c in cycles
    ]
    assert not cycles, "import cycles inside kvx/:\n" + "\n".join(shown)


def _registry_calls(path: Path) -> Iterator[int]:
    for node in ast.walk(_tree(path)):
        if isinstance(node, ast.Call):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            if name == "get_registry":
                yield node.lineno


def test_only_entry_points_call_get_registry() -> None:
    calls = {
        module: lines
        for folder in FOLDERS
        for path, module in _modules(folder)
        if (lines := list(_registry_calls(path)))
    }
    assert "kvx.cli.commands" in calls, (
        "the scan sees calls (the CLI is an entry point that makes them)"
    )
    below = {m: lines for m, lines in calls.items() if m not in ENTRY_POINTS}
    assert not below, f"get_registry() below the entry points (pass the registry in): {below}"
    stale = sorted(set(ENTRY_POINTS) - set(calls))
    assert not stale, f"allowed but no longer calling get_registry(), drop them: {stale}"


WING_LAYERS = [
    {"top"},  # kvx.errors, kvx.wire, kvx.discovery, kvx.tracing, kvx._version
    {"hooks", "config", "proxy"},
    {"contract", "topology"},
    {"storage"},
    {"registry"},
    {"engine", "adapters"},
    {"cli"},
]
"""docs/architecture.md's wings, lowest first: a wing imports only wings of lower layers."""


def _wing(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 2 or (len(parts) == 2 and _is_package(module)) else "top"


def _is_package(module: str) -> bool:
    return (ROOT / module.replace(".", "/") / "__init__.py").is_file()


def _wing_breaches(graph: dict[str, set[str]]) -> list[str]:
    layer = {wing: n for n, wings in enumerate(WING_LAYERS) for wing in wings}
    return sorted(
        f"{module} ({_wing(module)}) imports {dep} ({_wing(dep)})"
        for module, deps in graph.items()
        if module != "kvx"
        for dep in deps
        if _wing(dep) != _wing(module) and layer[_wing(dep)] >= layer[_wing(module)]
    )


def test_the_wing_check_finds_an_upward_import() -> None:
    graph = {"kvx.config.transfer": {"kvx.registry.core"}, "kvx.registry.core": {"kvx.errors"}}
    assert _wing_breaches(graph) == [
        "kvx.config.transfer (config) imports kvx.registry.core (registry)"
    ]


def test_wings_depend_one_way() -> None:
    graph = _core_graph()
    wings = {_wing(m) for m in graph if m != "kvx"}
    assert wings == set().union(*WING_LAYERS), "every wing has a layer, every layer a wing"
    breaches = _wing_breaches(graph)
    assert not breaches, "a wing imports a wing at its own level or above:\n" + "\n".join(breaches)
