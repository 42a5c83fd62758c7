"""The connector's docs run as written, and the benchmark runs end to end at a small size."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from kvx import KVTransferConfig

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "connectors" / "nixl.md"


def blocks(lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", DOC.read_text(), flags=re.S)


def test_doc_json_configs_validate() -> None:
    configs = blocks("json")
    assert len(configs) == 2
    for text in configs:
        config = KVTransferConfig.from_dict(json.loads(text))
        assert config.kv_connector == "NixlConnector"


def test_doc_lists_every_config_key() -> None:
    from kvx.plugins.nixl.config import NixlConfig

    text = DOC.read_text()
    missing = [key for key in NixlConfig.__struct_fields__ if f"| `{key}` |" not in text]
    assert not missing


@pytest.mark.timeout(120)
def test_doc_python_example_runs() -> None:
    (code,) = blocks("python")
    exec(compile(code, str(DOC), "exec"), {})


@pytest.mark.timeout(240)
def test_benchmark_quick_run() -> None:
    result = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "bench_nixl.py"),
            "--quick",
            "--repeat",
            "1",
            "--cases",
            "1:1,2:1",
        ],
        capture_output=True,
        text=True,
        timeout=230,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "raw NIXL" in result.stdout
    assert re.search(r"1:1 .* \d+\.\d\d .*>= 1\.0", result.stdout)
    assert re.search(r"2:1 .* \d+\.\d\d .*>= 0\.9", result.stdout)


@pytest.mark.timeout(240)
def test_push_benchmark_quick_run() -> None:
    """Push vs raw WRITE beside pull vs raw READ, every byte checked each round."""
    result = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "bench_nixl_push.py"),
            "--quick",
            "--repeat",
            "1",
            "--cases",
            "2:1",
        ],
        capture_output=True,
        text=True,
        timeout=230,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert re.search(r"2:1 .* \d+\.\d+ .*>= 1\.0", result.stdout), result.stdout
