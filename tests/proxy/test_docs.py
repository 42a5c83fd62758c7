"""docs/proxy.md's examples run as written and print what the page says (ports moved to free
ones so parallel runs do not clash; times, which differ per run, are masked)."""

from __future__ import annotations

import contextlib
import os
import re
import shlex
import signal
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(90)

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "proxy.md"
DOC_PORTS = ("8000", "8100", "8200", "8201")


def blocks_after(heading: str, language: str) -> tuple[str, str]:
    """The first `language` block after `heading` and the `text` block that follows it."""
    section = DOC.read_text(encoding="utf-8").split(heading, 1)[1]
    code = re.search(rf"```{language}\n(.*?)```", section, re.S)
    assert code is not None, f"no {language} block after {heading!r}"
    output = re.search(r"```text\n(.*?)```", section[code.end() :], re.S)
    assert output is not None, f"no output block after the {language} block of {heading!r}"
    return code.group(1), output.group(1)


def with_free_ports(*texts: str, free_port) -> list[str]:
    """The texts with each port of the page (`:PORT` or `--port PORT`) moved to a free one; a
    `kvx proxy` command that relies on the default port 8000 is told the port 8000 was moved
    to."""
    ports = {doc: str(free_port()) for doc in DOC_PORTS}
    moved = []
    for text in texts:
        for doc, free in ports.items():
            text = re.sub(rf"(?<=:){doc}\b|(?<=--port ){doc}\b", free, text)
        if f"--port {ports['8000']}" not in text:
            text = text.replace("kvx proxy --", f"kvx proxy --port {ports['8000']} --")
        moved.append(text)
    return moved


def mask_times(text: str) -> str:
    return re.sub(r"since \d\d:\d\d:\d\d", "since HH:MM:SS", text)


def run_bash(script: str) -> str:
    """stdout of a page's bash block run with this venv's programs; it must succeed."""
    script = script.replace(".venv/bin/", f"{Path(sys.executable).parent}/")
    # Its own session, so the proxy it starts in the background can be ended with it.
    bash = subprocess.Popen(
        ["bash", "-euo", "pipefail", "-c", script],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
        start_new_session=True,
    )
    try:
        out, err = bash.communicate(timeout=60)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(bash.pid, signal.SIGKILL)
    assert bash.returncode == 0, err
    return out


def test_try_it_prints_what_the_page_says(free_port):
    script, expected = blocks_after("## Try it", "bash")
    script, expected = with_free_ports(script, expected, free_port=free_port)
    assert mask_times(run_bash(script)) == mask_times(expected)


def test_python_api_example_prints_what_the_page_says(free_port):
    code, expected = blocks_after("## Python API", "python")
    code, expected = with_free_ports(code, expected, free_port=free_port)
    done = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout == expected


def test_flag_error_example_prints_what_the_page_says():
    section = DOC.read_text(encoding="utf-8").split("## Flags", 1)[1]
    example = re.search(r"```text\n\$ (kvx proxy .*?)\n(.*?)```", section, re.S)
    assert example is not None, "no `$ kvx proxy ...` example under ## Flags"
    command, expected = example.groups()
    kvx = Path(sys.executable).parent / "kvx"
    done = subprocess.run(
        [str(kvx), *shlex.split(command)[1:]],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 2
    assert done.stderr == expected


def test_service_discovery_example_prints_what_the_page_says(free_port):
    script, expected = blocks_after("## Service discovery", "bash")
    script, expected = with_free_ports(script, expected, free_port=free_port)
    discovery = str(free_port())
    script, expected = script.replace("30001", discovery), expected.replace("30001", discovery)
    assert run_bash(script) == expected
