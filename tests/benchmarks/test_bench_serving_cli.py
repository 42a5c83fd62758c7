"""benchmarks/bench_serving.py refuses `--plot` without matplotlib before starting any server,
saying which venv lacks it and the command that adds it (.venv-vllm is built without kvx's
`bench` extra). matplotlib is hidden from the script's Python (a `None` entry in
`sys.modules`): this venv has it, and the error is about a venv that does not."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_serving.py"
WITHOUT_MATPLOTLIB = (
    "import runpy, sys; sys.modules['matplotlib'] = None; sys.argv = sys.argv[1:]; "
    "runpy.run_path(sys.argv[0], run_name='__main__')"
)


def test_plot_without_matplotlib_names_the_venv_and_the_install() -> None:
    result = subprocess.run(
        [sys.executable, "-c", WITHOUT_MATPLOTLIB, str(SCRIPT), "--quick", "--plot", "x.png"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 2, result.stdout + result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    error = result.stderr.strip().splitlines()[-1]
    assert error.startswith("bench_serving.py: error: --plot needs matplotlib"), error
    assert sys.prefix in error and "`bench` extra" in error, error
    assert f"{sys.executable} -m pip install -c " in error, error
    assert error.endswith("requirements/vllm-cpu.txt matplotlib"), error
