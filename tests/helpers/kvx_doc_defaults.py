"""The defaults a connector's page in docs/connectors/ documents, read from its config table,
so a conformance run can prove it used exactly those (nothing set but what has no default)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

DOCS = Path(__file__).resolve().parents[2] / "docs" / "connectors"
ROW = re.compile(r"^\| `([a-z_]+)` \|(.*)$")


def documented_keys(page: str) -> dict[str, str]:
    """Every key of the page's `kv_connector_extra_config` table with its row's text (the
    table's first column is the key, in backticks)."""
    keys = {}
    for line in (DOCS / page).read_text().splitlines():
        match = ROW.match(line)
        if match:
            keys[match.group(1)] = match.group(2)
    if not keys:
        raise AssertionError(f"docs/connectors/{page} has no config table")
    return keys


def assert_documented_default(config: dict[str, Any], page: str, *needed: str) -> None:
    """`config` sets, of the documented keys, only `needed` (where the KV goes, a size the
    page says is required, a peer's address): every other key keeps its documented default."""
    keys = documented_keys(page)
    extra = config.get("kv_connector_extra_config", {})
    unknown = set(extra) - set(keys)
    assert not unknown, f"{sorted(unknown)} are not in docs/connectors/{page}"
    for key in needed:
        assert key in keys, f"{key} is not documented in docs/connectors/{page}"
    changed = set(extra) - set(needed)
    assert not changed, f"{sorted(changed)} differ from docs/connectors/{page}'s defaults"
    top = set(config) - {"kv_connector", "kv_connector_extra_config", "kv_role", "kv_port"}
    assert not top, f"top-level {sorted(top)} differ from the documented defaults"
