"""Mooncake Store (`mooncake://`): mooncake_cases.py in a pytest process whose environment
loads Mooncake's libibverbs (it must be on LD_LIBRARY_PATH when the process starts, and the
other tests' processes must not get it: NIXL's UCX would load it too), inside a network
namespace of its own where one can be made: Mooncake 0.3.13's client and metadata server
listen on every interface whatever they are told (checked with `ss`)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from kvx_test_clusters import mooncake_env, own_network_namespace


@pytest.mark.timeout(1200)  # the conformance case runs engines in processes of their own
def test_mooncake_cases_pass() -> None:
    cases = Path(__file__).with_name("mooncake_cases.py")
    command = [sys.executable, "-m", "pytest", str(cases), "-q", "-p", "no:cacheprovider"]
    isolated = own_network_namespace()
    if isolated:
        command = [*isolated, *command]
    else:
        print("no network namespace could be made: Mooncake's listeners are reachable from outside")
    result = subprocess.run(
        command,
        capture_output=True,
        text=True,
        timeout=1180,
        env=mooncake_env(),
        cwd=Path(__file__).resolve().parents[2],
        check=False,
    )
    out = result.stdout[-4000:] + result.stderr[-2000:]
    assert result.returncode == 0, out
    assert " passed" in result.stdout and "failed" not in result.stdout, out
