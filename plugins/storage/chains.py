"""fsspec's URL chaining (`simplecache::s3://bucket/kv`): each protocol before `::` wraps the
next one; the last part is the URL of the data."""

from __future__ import annotations

import difflib

import fsspec


def split_chain(url: str) -> tuple[list[str], str]:
    """The protocols of a chained URL's outer parts and its last part:
    `simplecache::s3://b/k` -> (["simplecache"], "s3://b/k"); an unchained URL -> ([], url)."""
    parts = url.split("::")
    return [part.split("://", 1)[0] for part in parts[:-1]], parts[-1]


def chain_problem(protocols: list[str]) -> str | None:
    """Why a chain of protocols cannot be opened (None if fsspec knows each of them)."""
    known = fsspec.available_protocols()
    for protocol in protocols:
        if protocol not in known:
            close = difflib.get_close_matches(protocol, known, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            return (
                f"protocol {protocol!r} is not known to fsspec{hint}; "
                "chain fsspec protocols, e.g. 'simplecache::s3://bucket/kv'"
            )
    return None


def missing_package(protocol: str) -> str | None:
    """What to install for a protocol fsspec knows but cannot load here (None if it loads)."""
    try:
        fsspec.get_filesystem_class(protocol)
    except ImportError as exc:
        return f"{exc}".strip() or f"fsspec cannot load protocol {protocol!r}"
    except ValueError:
        return None  # not a protocol at all: reported by chain_problem
    return None
