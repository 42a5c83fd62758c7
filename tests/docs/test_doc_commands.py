"""The shell blocks of docs/proxy.md marked `<!-- kvx: run -->` run as written (ports moved to
free ones: other servers on this machine may hold the page's) from a directory whose `.venv` is
this venv, and print what the page's next ```text block shows (clock times aside).

The serving recipes, which need vLLM, run in tests/vllm/serving/test_doc_recipes.py."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(120)

ROOT = Path(__file__).resolve().parents[2]
RUN_MARKER = "<!-- kvx: run -->"
BLOCK = re.compile(r"^```(\w+)\n(.*?)^```", re.MULTILINE | re.DOTALL)
PORTS = ("8100", "8200", "8000")
CLOCK = re.compile(r"\b\d\d:\d\d:\d\d\b")


def run_blocks(doc: Path) -> list[tuple[str, str, str]]:
    """(where, bash block, the text block after it) of every marked block of `doc`."""
    text = doc.read_text()
    blocks = list(BLOCK.finditer(text))
    found = []
    for i, match in enumerate(blocks):
        before = text[: match.start()].rstrip("\n").rsplit("\n", 1)[-1]
        if before.strip() != RUN_MARKER or match.group(1) != "bash":
            continue
        after = next((b.group(2) for b in blocks[i + 1 :] if b.group(1) == "text"), "")
        line = text.count("\n", 0, match.start()) + 1
        found.append((f"{doc.relative_to(ROOT)}:{line}", match.group(2), after))
    return found


BLOCKS = run_blocks(ROOT / "docs" / "proxy.md")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_proxy_page_marks_its_try_it_block() -> None:
    assert len(BLOCKS) == 1 and "kvx proxy" in BLOCKS[0][1]


@pytest.mark.parametrize(("where", "block", "expected"), BLOCKS, ids=[w for w, _, _ in BLOCKS])
def test_block_prints_what_the_page_shows(
    where: str, block: str, expected: str, tmp_path: Path
) -> None:
    (tmp_path / ".venv").symlink_to(Path(sys.executable).parents[1])
    ports = {written: str(free_port()) for written in PORTS}
    for written, port in ports.items():
        block = re.sub(rf"\b{written}\b", port, block)
        expected = re.sub(rf"\b{written}\b", port, expected)
    proc = subprocess.Popen(
        ["bash", "-c", block],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=90)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
    assert proc.returncode == 0, (where, err)
    assert CLOCK.sub("HH:MM:SS", out) == CLOCK.sub("HH:MM:SS", expected), where
