"""`kvx store`: list, inspect and evict the KV values a storage connector saved, through the
storage backend API (a backend must declare `kvx.SupportsListing`).

    kvx store ls URL [--prefix P] [--json]
    kvx store info URL KEY
    kvx store evict URL (--older-than DURATION | --prefix P | --all) [--dry-run]

Exit codes as kvx's: 0 done, 2 a bad URL, flag or key, 1 an internal error.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from collections.abc import Sequence
from typing import Any

import kvx

EXIT_OK, EXIT_USAGE = 0, 2
KEY_SHAPE = re.compile(r"^(?P<namespace>.+)/b(?P<block_size>\d+)/[0-9a-f]{2}/")
UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}
EXAMPLES = """examples:
  kvx store ls file:///tmp/kvx-kv
  kvx store ls redis://127.0.0.1:6379/0 --json
  kvx store info file:///tmp/kvx-kv KEY        # KEY as ls prints it
  kvx store evict file:///tmp/kvx-kv --older-than 2h --dry-run
  kvx store evict redis://127.0.0.1:6379/0 --prefix my-model-float16-k8d128/
  kvx store ls s3://bucket/kv --storage-options '{"endpoint_url": "http://127.0.0.1:8333"}'

DURATION: a number with a unit s, m, h, d or w (90s, 30m, 2h, 7d).
"""


class UsageError(Exception):
    """A bad URL, flag or key: printed, exit 2."""


def duration(text: str) -> float:
    """argparse type of --older-than: `90s`, `30m`, `2h`, `7d`, `1w`."""
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([smhdw])", text.strip())
    if match is None:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not allowed: use a number and a unit s, m, h, d or w (e.g. 2h)"
        )
    return float(match.group(1)) * UNITS[match.group(2)]


def storage_options(text: str) -> dict[str, Any]:
    """argparse type of --storage-options: a JSON object (fsspec's keyword arguments)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"{text[:60]!r} is not valid JSON: {exc.msg}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"{text[:60]!r} is not allowed: use a JSON object")
    return value


def parser(prog: str) -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(
        prog=prog,
        description="List, inspect and evict the KV values stored at a storage URL "
        "(file://, memory://, redis://, ...).",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--storage-options",
        type=storage_options,
        metavar="JSON",
        help="the store's fsspec options, as the connector's storage_options (an S3 endpoint...)",
    )
    sub = top.add_subparsers(dest="action", metavar="ACTION", required=True)
    p_ls = sub.add_parser(
        "ls", parents=[common], help="list stored values: key, size, namespace, age"
    )
    p_ls.add_argument("url", metavar="URL", help="the store's storage_url")
    p_ls.add_argument("--prefix", default="", metavar="P", help="only keys starting with P")
    p_ls.add_argument("--json", action="store_true", help="print JSON lines, one per value")
    p_info = sub.add_parser(
        "info", parents=[common], help="a stored value's header, and whether its checksum holds"
    )
    p_info.add_argument("url", metavar="URL", help="the store's storage_url")
    p_info.add_argument("key", metavar="KEY", help="the key, as `ls` prints it")
    p_evict = sub.add_parser(
        "evict", parents=[common], help="remove stored values by age or key prefix"
    )
    p_evict.add_argument("url", metavar="URL", help="the store's storage_url")
    p_evict.add_argument(
        "--older-than",
        type=duration,
        metavar="DURATION",
        help="only values last written longer ago than this (90s, 30m, 2h, 7d)",
    )
    p_evict.add_argument("--prefix", default="", metavar="P", help="only keys starting with P")
    p_evict.add_argument("--all", action="store_true", help="every value (no filter needed)")
    p_evict.add_argument(
        "--dry-run", action="store_true", help="print what would be removed, remove nothing"
    )
    return top


def run(prog: str, argv: Sequence[str]) -> int:
    """Entry point (`kvx_cli_commands`): run `kvx store ARGV`, return the exit code."""
    try:
        args = parser(prog).parse_args(list(argv))
    except SystemExit as exc:
        return int(exc.code or 0) if isinstance(exc.code, int) else EXIT_USAGE
    try:
        if args.action == "evict" and not (args.older_than or args.prefix or args.all):
            raise UsageError(
                "evict needs a filter: --older-than, --prefix, or --all for everything"
            )
        backend = _open(args.url, args.storage_options)
        try:
            action = {"ls": _cmd_ls, "info": _cmd_info, "evict": _cmd_evict}[args.action]
            return action(backend, args)
        finally:
            backend.close()
    except UsageError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_USAGE


def _open(url: str, options: dict[str, Any] | None) -> Any:
    """The backend at `url`, able to list; a `UsageError` naming the URL otherwise."""
    shown = kvx.redact_url(url)
    if url.startswith(("file://", "local://")):
        path = url.partition("://")[2]
        if not os.path.isdir(path):  # opening would create it: nothing is stored there
            raise UsageError(f"URL {shown!r}: no store there ({path} is not a directory)")
    try:
        backend = kvx.open_storage_backend(url, kvx.StorageBackendOptions(storage_options=options))
    except (kvx.ConfigError, kvx.RegistryError, TypeError) as exc:  # TypeError: not a backend
        raise UsageError(f"URL {shown!r}: {_problems(exc)}") from None
    if not kvx.supports_listing(backend):
        backend.close()
        raise UsageError(
            f"URL {shown!r}: this store ({type(backend).__name__}) cannot list keys, so kvx store "
            "cannot read it (its backend does not declare kvx.SupportsListing)"
        )
    return backend


def _problems(exc: Exception) -> str:
    problems = getattr(exc, "problems", None)
    return "; ".join(p.message for p in problems) if problems else str(exc)


def _described(entry: kvx.StoredEntry, now: float) -> dict[str, Any]:
    match = KEY_SHAPE.match(entry.key)
    return {
        "key": entry.key,
        "size": entry.size,
        "namespace": match["namespace"] if match else None,
        "block_size": int(match["block_size"]) if match else None,
        "age_s": None if entry.modified is None else round(max(now - entry.modified, 0.0), 3),
    }


def _cmd_ls(backend: Any, args: argparse.Namespace) -> int:
    now = time.time()
    rows = [_described(e, now) for e in sorted(backend.list_keys(args.prefix), key=_by_key)]
    if args.json:
        for row in rows:
            print(json.dumps(row))
        return EXIT_OK
    print(f"{'SIZE':>10}  {'AGE':>6}  {'NAMESPACE':<40}  KEY")
    for row in rows:
        age = "-" if row["age_s"] is None else _age(row["age_s"])
        print(f"{row['size']:>10}  {age:>6}  {row['namespace'] or '-':<40}  {row['key']}")
    total = sum(row["size"] for row in rows)
    print(f"{len(rows)} values, {total} bytes", file=sys.stderr)
    return EXIT_OK


def _by_key(entry: kvx.StoredEntry) -> str:
    return entry.key


def _age(seconds: float) -> str:
    for unit in ("w", "d", "h", "m"):
        if seconds >= UNITS[unit]:
            return f"{int(seconds // UNITS[unit])}{unit}"
    return f"{int(seconds)}s"


def _cmd_info(backend: Any, args: argparse.Namespace) -> int:
    from kvx.plugins.storage.store_info import MAX_VALUE_BYTES, describe_value  # imports torch

    (data,) = backend.get_many([args.key], MAX_VALUE_BYTES)
    if data is None:
        raise UsageError(f"KEY {args.key!r} is not stored at {kvx.redact_url(args.url)!r}")
    for name, value in describe_value(args.key, data):
        print(f"{name + ':':<14}{value}")
    return EXIT_OK


def _cmd_evict(backend: Any, args: argparse.Namespace) -> int:
    now = time.time()
    chosen: list[kvx.StoredEntry] = []
    for entry in backend.list_keys(args.prefix):
        if args.older_than is not None:
            if entry.modified is None:
                raise UsageError(
                    f"URL {kvx.redact_url(args.url)!r}: this store does not record when values "
                    "were written, so --older-than cannot choose; use --prefix (or a TTL: "
                    "redis_ttl_s)"
                )
            if now - entry.modified <= args.older_than:
                continue
        chosen.append(entry)
    chosen.sort(key=_by_key)
    for entry in chosen:
        print(f"{'would remove' if args.dry_run else 'remove'} {entry.key} ({entry.size} bytes)")
    removed = 0 if args.dry_run else backend.delete_many([e.key for e in chosen])
    size = sum(e.size for e in chosen)
    verb = "would remove" if args.dry_run else f"removed {removed} of"
    print(f"{verb} {len(chosen)} values, {size} bytes", file=sys.stderr)
    return EXIT_OK
