"""Install hints name the command that works for the way kvx was installed: kvx is on no
package index, so from a source checkout the hint installs the checkout's extra."""

from __future__ import annotations

from pathlib import Path

import pytest

import kvx
from kvx.registry import loading

ROOT = Path(__file__).resolve().parents[2]


def test_this_editable_checkout_gets_pip_install_e_of_its_directory() -> None:
    assert kvx.install_hint("nixl", "nixl") == f"pip install -e '{ROOT}[nixl]'"
    assert kvx.install_hint(None, "s3fs") == "pip install s3fs"


@pytest.mark.parametrize(
    ("source", "hint"),
    [
        (None, "pip install 'kvx[redis]'"),  # from an index (or a wheel file)
        (("/src/kvx", False), "pip install '/src/kvx[redis]'"),
        (("/src/kvx", True), "pip install -e '/src/kvx[redis]'"),
    ],
)
def test_each_way_of_installing(
    monkeypatch: pytest.MonkeyPatch, source: tuple[str, bool] | None, hint: str
) -> None:
    monkeypatch.setattr(loading, "_install_source", lambda: source)
    assert kvx.install_hint("redis", "redis") == hint
