"""`kvx conformance` refuses bad scenario names and matrix cells with exit 2 and a clear
message: a did-you-mean for a misspelt scenario, the allowed dtypes and block sizes."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kvx.conformance import SuiteOptions

KVX = shutil.which("kvx", path=str(Path(sys.executable).parent))
CONFIG = {"kv_connector": "SharedStorageConnector"}


def conformance(*args: str) -> subprocess.CompletedProcess[str]:
    assert KVX is not None
    return subprocess.run(
        [KVX, "conformance", "--kv-transfer-config", json.dumps(CONFIG), *args],
        capture_output=True,
        text=True,
        timeout=100,
        check=False,
    )


@pytest.mark.timeout(120)
def test_a_misspelt_scenario_gets_a_did_you_mean() -> None:
    result = conformance("--scenario", "store_and_reus")
    assert result.returncode == 2, result.stdout + result.stderr
    output = " ".join((result.stdout + result.stderr).split())
    assert "unknown scenario(s) ['store_and_reus'] (did you mean" in output, output
    assert "store_and_reuse" in output and "Traceback" not in output, output


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("flag", "value", "allowed"),
    [
        ("--dtype", "int8", "pick one of ('float32', 'float16', 'bfloat16')"),
        ("--block-size", "24", "24 is not a power of two from 1 to 256"),
    ],
)
def test_a_bad_matrix_cell_is_a_bad_flag(flag: str, value: str, allowed: str) -> None:
    result = conformance(flag, value, "--scenario", "matrix")
    assert result.returncode == 2, result.stdout + result.stderr
    assert allowed in result.stderr and "Traceback" not in result.stderr, result.stderr


def test_suite_options_name_the_field() -> None:
    with pytest.raises(ValueError, match=r"SuiteOptions\.dtypes: .float64. is not a KV dtype"):
        SuiteOptions(dtypes=("float64",))
    with pytest.raises(ValueError, match="must name at least one each"):
        SuiteOptions(block_sizes=())
