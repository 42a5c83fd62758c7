"""docs/reference.md documents every public name of the types a connector touches, and nothing
that is not there: each `### \\`Type\\`` section's table names exactly the type's fields,
properties and methods (its own, not inherited from kvx's base classes)."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Any

import pytest

import kvx
from kvx.contract.planning import PlanningScheduler, RequestTracker

DOC = Path(__file__).resolve().parents[2] / "docs" / "reference.md"
HEADING = re.compile(r"^#{2,3} `(\w+)", re.MULTILINE)
ROW_NAMES = re.compile(r"^\| (`[^|]*`) \|", re.MULTILINE)


def documented() -> dict[str, set[str]]:
    """Section name -> the names in the first column of its table."""
    text = DOC.read_text()
    starts = list(HEADING.finditer(text))
    sections = {}
    for i, match in enumerate(starts):
        end = starts[i + 1].start() if i + 1 < len(starts) else len(text)
        body = text[match.end() : end].split("\n## ", 1)[0]  # a plain ## heading ends it too
        names = {n for cell in ROW_NAMES.findall(body) for n in re.findall(r"`(\w+)`", cell)}
        sections[match.group(1)] = names - {"name"}
    return sections


def own_public(cls: type) -> set[str]:
    """The fields, properties and methods `cls` itself defines, without a leading underscore."""
    names = {f.name for f in dataclasses.fields(cls)} if dataclasses.is_dataclass(cls) else set()
    names |= set(getattr(cls, "__annotations__", {}))
    names |= {n for n in vars(cls) if not n.startswith("_")}
    return {n for n in names if not n.startswith("_")} - {"__orig_bases__"}


def public(obj: Any) -> set[str]:
    if obj is RequestTracker:  # its attributes are set in __init__
        return own_public(obj) | {n for n in vars(RequestTracker("x")) if not n.startswith("_")}
    if obj is PlanningScheduler:
        return own_public(obj)
    if isinstance(obj, type):
        return own_public(obj)
    return {obj.__name__}  # a function: its own name


TYPES = [
    "Request",
    "KVCacheBlocks",
    "SchedulerOutput",
    "NewRequestData",
    "CachedRequestData",
    "yield_req_data",
    "ForwardContext",
    "EngineContext",
    "KVCacheSpec",
    "ParallelInfo",
    "RequestTracker",
    "PlanningScheduler",
]
SECTIONS = documented()


def test_the_reference_has_a_section_per_type() -> None:
    assert set(TYPES) <= set(SECTIONS), set(TYPES) - set(SECTIONS)


@pytest.mark.parametrize("name", TYPES)
def test_every_public_name_is_documented_and_every_documented_name_exists(name: str) -> None:
    code = public(getattr(kvx, name))
    doc = SECTIONS[name]
    assert code - doc == set(), f"{name}: not in docs/reference.md"
    assert doc - code == set(), f"{name}: documented but not in the code"


def test_the_config_hooks_are_documented() -> None:
    text = DOC.read_text()
    for hook in ("config_notes", "config_checks"):
        assert f"| `{hook}` |" in text
