"""Running an example package's own tests the way its author does: plain pytest in the
package's directory, in a process of their own."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path


def run_package_tests(
    package: Path, *args: str, timeout: float
) -> subprocess.CompletedProcess[str]:
    """`python -m pytest tests ARGS` in `package` (no pytest cache left there); the output is
    captured, a failure is the caller's to assert."""
    return subprocess.run(
        [sys.executable, "-m", "pytest", "tests", "-p", "no:cacheprovider", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
        cwd=package,
    )
