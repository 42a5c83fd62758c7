"""kvx on a host with the distribution's RDMA libraries (libibverbs1, ibverbs-providers): there
UCX's EFA module loads the host's libefa and libibverbs, which bring the host's libnl-route next
to the copy bundled in the nixl wheel, and the two copies crash every NIXL process at exit
(SIGSEGV). kvx leaves the EFA module out unless the operator set `UCX_MODULES`. The libraries
are installed privately for the child processes these tests start (tests/helpers/rdma_libs.py);
the first test proves the host really crashes raw NIXL, so the others cannot pass vacuously."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from rdma_libs import RdmaLibsUnavailable, rdma_env

pytestmark = pytest.mark.timeout(300)

REPORT = """
import re
libs = {line.split()[-1].rsplit("/", 1)[-1] for line in open("/proc/self/maps")}
print("LOADED", " ".join(sorted(x for x in libs if re.match(r"lib(efa|ibverbs|uct_ib)", x))))
"""
RAW = """from nixl._api import nixl_agent, nixl_agent_config
agent = nixl_agent("raw", nixl_agent_config(enable_prog_thread=False, backends=["UCX"]))
"""
KVX = """from kvx.plugins.nixl.agent import make_agent
agent = make_agent("kvx", ["UCX"], 0, "127.0.0.1")
"""


@pytest.fixture(scope="module")
def env() -> dict[str, str]:
    try:
        found = rdma_env()
    except RdmaLibsUnavailable as exc:
        pytest.fail(
            f"no host with RDMA libraries can be made here (CI runs these, never skips them): {exc}"
        )
    found.pop("UCX_MODULES", None)
    return found


def run_agent(code: str, env: dict[str, str]) -> tuple[int, set[str], str]:
    """Run `code` (which builds an agent) in a fresh interpreter: its exit code, the RDMA
    libraries it had loaded, its output."""
    done = subprocess.run(
        [sys.executable, "-c", code + REPORT],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    out = done.stdout + done.stderr
    loaded = [line for line in done.stdout.splitlines() if line.startswith("LOADED")]
    assert loaded, f"the agent was not built (exit {done.returncode}):\n{out[-3000:]}"
    return done.returncode, set(loaded[0].split()[1:]), out


def test_this_host_crashes_raw_nixl_at_exit(env: dict[str, str]) -> None:
    code, loaded, out = run_agent(RAW, env)
    assert "libefa.so.1" in {lib.split(".so")[0] + ".so.1" for lib in loaded if "efa" in lib}
    assert code == -signal.SIGSEGV, f"raw NIXL exited {code} on this host:\n{out[-3000:]}"


def test_kvx_agent_exits_cleanly_and_keeps_infiniband(env: dict[str, str]) -> None:
    for _ in range(2):
        code, loaded, out = run_agent(KVX, env)
        assert code == 0, f"kvx's agent exited {code}:\n{out[-3000:]}"
        assert not [lib for lib in loaded if lib.startswith("libefa")], loaded
        assert "libuct_ib.so.0.0.0" in loaded  # UCX's InfiniBand transport is still there
        assert any(lib.startswith("libibverbs-") for lib in loaded)  # through the wheel's verbs


def test_operator_ucx_modules_is_kept(env: dict[str, str]) -> None:
    code, loaded, _ = run_agent(KVX, {**env, "UCX_MODULES": "^cuda"})
    assert [lib for lib in loaded if lib.startswith("libefa")], loaded
    assert code == -signal.SIGSEGV  # what the operator asked for, with its crash


def run_clean(argv: list[str], env: dict[str, str]) -> None:
    """Run `argv`: it and every process under it must exit cleanly (a crash in any of them
    prints "Fatal Python error" through PYTHONFAULTHANDLER)."""
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=240)
    out = done.stdout + done.stderr
    assert done.returncode == 0, f"{argv} exited {done.returncode}:\n{out[-3000:]}"
    assert "Fatal Python error" not in out, out[-3000:]


def test_nixl_test_module_exits_cleanly(env: dict[str, str]) -> None:
    """A NIXL test module whose engines run in pytest's own process (it crashed at exit with
    SIGSEGV before kvx left the EFA module out)."""
    module = Path(__file__).parent / "test_posting.py"
    run_clean([sys.executable, "-m", "pytest", str(module), "-q", "-p", "no:cacheprovider"], env)


def test_demo_with_nixl_exits_cleanly(env: dict[str, str]) -> None:
    """`kvx demo`'s P and D engine processes moving KV over NIXL (they release their agents
    before exiting, so they exited cleanly here even before the fix: a guard, not a repro)."""
    kv = {"kv_connector": "NixlConnector", "kv_connector_extra_config": {"kv_lease_duration": 10}}
    run_clean(
        [str(Path(sys.executable).parent / "kvx"), "demo", "--kv-transfer-config", json.dumps(kv)],
        env,
    )


def test_troubleshooting_check_runs_as_written(env: dict[str, str]) -> None:
    """docs/connectors/nixl.md's check of a host prints exit 0 and no libefa here."""
    doc = (Path(__file__).parents[2] / "docs" / "connectors" / "nixl.md").read_text()
    (check,) = [
        b for b in re.findall(r"```bash\n(.*?)```", doc, flags=re.S) if 'make_agent("check"' in b
    ]
    path = f"{Path(sys.executable).parent}:{env.get('PATH', '')}"  # `python` is this venv's
    done = subprocess.run(
        ["bash", "-c", check],
        env={**env, "PATH": path},
        capture_output=True,
        text=True,
        timeout=120,
    )
    lines = done.stdout.strip().splitlines()
    assert lines[-1] == "exit 0", done.stdout + done.stderr
    assert "libibverbs-" in lines[-2] and "libefa" not in lines[-2], lines
