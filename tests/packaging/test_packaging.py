"""kvx as a package others install and depend on: the wheel builds without a warning from
kvx's own packaging (setuptools' notes on ext-modules, undeclared package data, ...), carries
its native extensions, typing markers and licenses, and a fresh venv installs it with an extra,
then installs the example connector from its own directory (its `kvx>=0.1,<2` requirement met
by that wheel, as docs/writing-a-connector.md tells third parties to do before kvx is on an
index) and runs a few of the connector's own tests there
(tests/conformance/test_example_connector.py runs its whole suite, alone and with a Redis store)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import zipfile
from importlib.metadata import distribution
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(1800)

ROOT = Path(__file__).resolve().parents[2]
TORCH = "torch==2.13.0+cpu"  # the Makefile's pin (an unpinned torch is a multi-GB CUDA build)


def run(argv: list[str], cwd: Path, timeout: float = 900) -> str:
    done = subprocess.run(argv, cwd=cwd, capture_output=True, text=True, timeout=timeout)
    output = done.stdout + done.stderr
    assert done.returncode == 0, f"{' '.join(argv)} failed:\n{output[-4000:]}"
    return output


def link_torch(venv: Path) -> None:
    """Put this venv's torch (the Makefile's pin) into `venv` as hard links of its installed
    files, dist-info included, instead of unpacking the wheel again: pip then finds the pin
    installed. Unpacking 750 MB took minutes of IO on a loaded machine; the files are the same
    bytes. torch's console scripts (outside site-packages) are left out."""
    torch = distribution("torch")
    assert torch.version == TORCH.split("==")[1], torch.version
    site = venv / "lib" / f"python{sys.version_info[0]}.{sys.version_info[1]}" / "site-packages"
    assert site.is_dir(), site
    for file in torch.files or []:
        if file.parts[0] == "..":
            continue
        target = site / file
        target.parent.mkdir(parents=True, exist_ok=True)
        os.link(Path(str(file.locate())), target)


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """The wheel `pip wheel` builds from this checkout (a copy: no build leftovers here), and
    the build's output."""
    src = tmp_path_factory.mktemp("src") / "kvx"
    tracked = run(["git", "ls-files", "-z"], ROOT).split("\0")
    for name in filter(None, tracked):
        if (ROOT / name).is_file():
            (src / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, src / name)
    dist = tmp_path_factory.mktemp("dist")
    pip = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation"]
    output = run([*pip, "-w", str(dist), str(src)], src)
    (wheel,) = dist.glob("kvx-*.whl")
    return wheel, output


def test_the_build_warns_about_nothing(built: tuple[Path, str]) -> None:
    _, output = built
    noise = [line for line in output.splitlines() if "warning" in line.lower() or "!!" in line]
    assert noise == [], "\n".join(noise)


def test_the_wheel_carries_extensions_markers_and_licenses(built: tuple[Path, str]) -> None:
    wheel, _ = built
    names = set(zipfile.ZipFile(wheel).namelist())
    for wanted in (
        "kvx/py.typed",
        "kvx/plugins/storage/_fileio.pyi",
        "kvx/contract/_digest.pyi",
        "kvx-0.1.0.dist-info/licenses/LICENSE",
        "kvx-0.1.0.dist-info/licenses/vendor/xxhash/LICENSE",
    ):
        assert wanted in names, wanted
    native = sorted(n for n in names if n.endswith(".so"))
    assert [n.split(".")[0] for n in native] == [
        "kvx/contract/_digest",
        "kvx/layouts/_native",
        "kvx/plugins/storage/_fileio",
    ]
    assert not [n for n in names if "vendor" in n and not n.endswith("LICENSE")]


def test_a_fresh_venv_installs_the_wheel_and_the_example_connector(
    built: tuple[Path, str], tmp_path: Path
) -> None:
    wheel, _ = built
    venv = tmp_path / "venv"
    run([sys.executable, "-m", "venv", str(venv)], tmp_path)
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "--quiet"]
    link_torch(venv)
    assert f"Requirement already satisfied: {TORCH}" in run([*pip[:-1], TORCH], tmp_path)
    constraints = ["-c", str(ROOT / "constraints.txt")]
    run([*pip, *constraints, f"{wheel}[redis]", "pytest", "pytest-timeout"], tmp_path)
    # the connector's own repository, as a third party has it
    repo = tmp_path / "kvx-example-connector"
    shutil.copytree(ROOT / "examples" / "kvx-example-connector", repo)
    run([*pip, "."], repo)  # kvx>=0.1,<2 is met by the installed wheel: no index asked for kvx
    listed = run([str(venv / "bin" / "kvx"), "list"], repo)
    assert "ExamplePDConnector" in listed
    # the connector's own tests run from the wheel: a few scenarios, alone and composed with a
    # Redis store (both whole suites run in tests/conformance/test_example_connector.py)
    chosen = "pd_short_prompt or abort_on_prefill or store_and_reuse or claims_cover"
    pytest_argv = ["-m", "pytest", "tests", "-q", "-p", "no:cacheprovider", "-k", chosen]
    tests = run([str(venv / "bin" / "python"), *pytest_argv], repo, timeout=1500)
    composed = re.search(r"MultiConnector: (\d+) passed", tests)
    assert composed and int(composed.group(1)) >= 3, tests[-3000:]  # the composition ran
    summary = tests.strip().splitlines()[-1]
    assert " passed" in summary, tests[-3000:]
    assert not re.search(r"\b\d+ (failed|errors?)\b", summary), tests[-3000:]
