"""Comments cite what a reader can open: no docstring or comment points at numbered sections of
a reference document that is not in the repository."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("kvx", "plugins", "conformance", "layouts", "examples")
# "reference 5.5", "section 8", "sections 4.2-4.4": numbered parts of an outside document
NUMBERED = re.compile(r"\b(?:reference|sections?)\s+\d+(?:\.\d+)*\b", re.IGNORECASE)


def test_no_source_cites_numbered_sections_of_a_missing_document() -> None:
    found = [
        f"{path.relative_to(ROOT)}:{n}: {line.strip()}"
        for package in PACKAGES
        for path in sorted((ROOT / package).rglob("*.py"))
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if NUMBERED.search(line)
    ]
    assert not found, "cite vLLM's files or docs/*.md instead:\n" + "\n".join(found)
