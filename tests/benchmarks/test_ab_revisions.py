"""benchmarks/ab_revisions.py: alternating runs of two checkouts, ratios read and compared.

The two "checkouts" are directories holding a `.venv/bin/python` (this interpreter) and a
`benchmarks/` script that prints a ratio and which checkout it ran in: real processes, as the
runner starts them for real benchmarks.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

RUNNER = Path(__file__).resolve().parents[2] / "benchmarks" / "ab_revisions.py"
SCRIPT = """import os, sys, time
from pathlib import Path
tree = Path.cwd().name
log = Path(os.environ["AB_ORDER"])
with log.open("a") as f:
    f.write(f"{tree} {Path(__file__).parent.parent.name} {' '.join(sys.argv[1:])}\\n")
if "--hang" in sys.argv:
    time.sleep(60)
value = {"old": 1.0, "new": 2.0}[tree] + len(log.read_text().splitlines()) / 100
print(f"ratio: {value:.2f}x, threads {os.environ['OMP_NUM_THREADS']}")
"""


def checkout(root: Path, name: str) -> Path:
    tree = root / name
    (tree / ".venv" / "bin").mkdir(parents=True)
    (tree / ".venv" / "bin" / "python").symlink_to(sys.executable)
    (tree / "benchmarks").mkdir()
    (tree / "benchmarks" / "fake.py").write_text(SCRIPT)
    return tree


def ab(tmp_path: Path, *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    old, new = checkout(tmp_path, "old"), checkout(tmp_path, "new")
    argv = [sys.executable, str(RUNNER), "--old", str(old), "--new", str(new)]
    argv += ["--out", str(tmp_path / "logs"), *args]
    env = {"AB_ORDER": str(tmp_path / "order"), "PATH": "/usr/bin:/bin"}
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=env)


@pytest.mark.timeout(60)
def test_runs_alternate_and_each_revisions_ratios_are_summarised(tmp_path: Path) -> None:
    got = ab(tmp_path, "--runs", "2", "--new-extra=--x", "--ratio", r"r=ratio: ([\d.]+)x",
             "--", "fake.py", "--a")  # fmt: skip
    assert got.returncode == 0, got.stderr
    order = (tmp_path / "order").read_text().splitlines()
    # old, new, old, new; each checkout runs its own script; --new-extra only on new runs
    assert order == ["old old --a", "new new --a --x", "old old --a", "new new --a --x"]
    # old runs read 1.01 and 1.03, new ones 2.02 and 2.04: the ranges do not overlap
    assert "| r | 1.020 [1.010-1.030] (2) | 2.030 [2.020-2.040] (2) | NO |" in got.stdout
    assert "threads 1" in (tmp_path / "logs" / "fake-new-1.log").read_text()
    # read again from the logs, with nothing run
    again = ab_from_logs(tmp_path)
    assert "| r | 1.020 [1.010-1.030] (2) | 2.030 [2.020-2.040] (2) | NO |" in again
    assert len((tmp_path / "order").read_text().splitlines()) == 4


def ab_from_logs(tmp_path: Path) -> str:
    argv = [sys.executable, str(RUNNER), "--old", str(tmp_path / "old"), "--new"]
    argv += [str(tmp_path / "new"), "--out", str(tmp_path / "logs"), "--runs", "2"]
    argv += ["--from-logs", "--ratio", r"r=ratio: ([\d.]+)x", "--", "fake.py"]
    env = {"AB_ORDER": str(tmp_path / "order"), "PATH": "/usr/bin:/bin"}
    done = subprocess.run(argv, capture_output=True, text=True, timeout=30, env=env, check=True)
    return done.stdout


@pytest.mark.timeout(60)
def test_script_from_new_runs_the_new_script_in_both_checkouts(tmp_path: Path) -> None:
    got = ab(tmp_path, "--runs", "1", "--script-from", "new", "--ratio", r"r=ratio: ([\d.]+)x",
             "--", "fake.py")  # fmt: skip
    assert got.returncode == 0, got.stderr
    assert (tmp_path / "order").read_text().splitlines() == ["old new ", "new new "]


@pytest.mark.timeout(60)
def test_a_run_past_its_timeout_is_killed_and_gives_no_value(tmp_path: Path) -> None:
    got = ab(tmp_path, "--runs", "1", "--timeout", "2", "--ratio", r"r=ratio: ([\d.]+)x",
             "--", "fake.py", "--hang")  # fmt: skip
    assert got.returncode == 0, got.stderr
    assert "killed after 2s" in (tmp_path / "logs" / "fake-old-0.log").read_text()
    assert "| r | no value | no value | - |" in got.stdout


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("args", "error"),
    [
        (["--ratio", "no-equals-sign", "--", "fake.py"], "expected NAME=REGEX"),
        (["--ratio", "r=(unclosed", "--", "fake.py"], "bad regex"),
        (["--ratio", "r=no group", "--", "fake.py"], "needs a (number) group"),
        (["--ratio", "r=(x)", "--runs", "0", "--", "fake.py"], "--runs: 0 is not allowed"),
        (["--ratio", "r=(x)", "--", "fake.sh"], "expected '-- SCRIPT.py"),
        (["--ratio", "r=(x)", "--venv", ".nope", "--", "fake.py"], "has no .nope/bin/python"),
    ],
)
def test_bad_options_exit_2_naming_the_option(tmp_path: Path, args: list[str], error: str) -> None:
    got = ab(tmp_path, *args)
    assert got.returncode == 2
    assert error in got.stderr
    assert "Traceback" not in got.stderr
