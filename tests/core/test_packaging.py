"""Packaging: a regular (non-editable) wheel holds every subpackage under its kvx.* name."""

from __future__ import annotations

import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

import kvx

ROOT = Path(__file__).resolve().parents[2]
PACKAGE_ROOTS = {
    "kvx": "kvx",
    "kvx.plugins": "plugins",
    "kvx.layouts": "layouts",
    "kvx.conformance": "conformance",
}


def source_packages() -> set[str]:
    """Every directory with an __init__.py under the four roots, as its import name."""
    found = set()
    for name, folder in PACKAGE_ROOTS.items():
        for init in (ROOT / folder).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT / folder)
            if "__pycache__" not in rel.parts:
                found.add(".".join([name, *rel.parts]) if rel.parts else name)
    return found


def test_pyproject_lists_every_package() -> None:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    listed = set(config["tool"]["setuptools"]["packages"])
    assert listed == source_packages()
    assert config["tool"]["setuptools"]["package-dir"] == PACKAGE_ROOTS


def test_version_has_one_source() -> None:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert config["project"]["dynamic"] == ["version"]
    from importlib.metadata import version

    assert version("kvx") == kvx.__version__


@pytest.mark.timeout(180)
def test_wheel_contains_every_package(tmp_path: Path) -> None:
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--quiet",
            "--no-deps",
            "--no-build-isolation",
            "--wheel-dir",
            str(tmp_path),
            str(ROOT),
        ],
        check=True,
        timeout=170,
        capture_output=True,
    )
    (wheel,) = tmp_path.glob("kvx-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    for package in source_packages():
        assert f"{package.replace('.', '/')}/__init__.py" in names, package
    assert "kvx/py.typed" in names
    entry_points = next(n for n in names if n.endswith("entry_points.txt"))
    text = zipfile.ZipFile(wheel).read(entry_points).decode()
    assert "[console_scripts]\nkvx = kvx.cli.commands:run" in text
