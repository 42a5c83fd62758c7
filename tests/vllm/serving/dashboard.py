"""The Grafana dashboard in docs/grafana/ against real scrapes: every metric each panel query
names exists, with every label the query selects or groups by."""

from __future__ import annotations

import json
import re
from pathlib import Path

DASHBOARD = Path(__file__).resolve().parents[3] / "docs" / "grafana" / "kvx-dashboard.json"
METRIC = re.compile(r"\b(kvx_[a-z_]+|vllm:[a-z_:]+)")
SELECTOR_LABEL = re.compile(r"[{,]\s*([a-z_]+)\s*(?:=~|!=|!~|=)")
GROUPING = re.compile(r"\bby \(([^)]*)\)")


def queries() -> list[str]:
    document = json.loads(DASHBOARD.read_text())
    return [t["expr"] for panel in document["panels"] for t in panel["targets"]]


def labels_of(expr: str) -> set[str]:
    keys = set(SELECTOR_LABEL.findall(expr))
    for group in GROUPING.findall(expr):
        keys |= {k.strip() for k in group.split(",") if k.strip()}
    return keys


def problems(scraped: dict[str, set[str]]) -> list[str]:
    """`scraped`: sample name -> the label keys seen on it. One line per query naming a
    metric no scrape had, or a label none of its metrics carries."""
    bad = []
    for expr in queries():
        names = METRIC.findall(expr)
        if not names:
            bad.append(f"{expr}: names no kvx_ or vllm: metric")
        missing = [n for n in names if n not in scraped]
        if missing:
            bad.append(f"{expr}: {missing} not in any scrape")
            continue
        have = set().union(*(scraped[n] for n in names))
        if labels_of(expr) - have:
            bad.append(f"{expr}: labels {sorted(labels_of(expr) - have)} not on {names}")
    return bad
