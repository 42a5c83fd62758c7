"""`kvx --help` and each command's help say what it does, its defaults, choices and an example;
`kvx list` keeps every name whole at 80 columns."""

from __future__ import annotations

import fcntl
import json
import os
import pty
import struct
import subprocess
import sys
import termios
from pathlib import Path

import pytest

KVX = Path(sys.executable).parent / "kvx"


def kvx(*args: str, columns: int = 100) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "COLUMNS": str(columns), "NO_COLOR": "1", "TERM": "dumb"}
    return subprocess.run(
        [str(KVX), *args], capture_output=True, text=True, timeout=60, env=env, check=False
    )


def test_top_level_help_describes_and_gives_examples() -> None:
    result = kvx("--help")
    assert result.returncode == 0, result.stderr
    assert "pluggable KV-cache transfer SDK" in result.stdout
    assert "examples:\n  kvx list\n  kvx demo\n" in result.stdout
    for command in ("list", "validate", "demo", "proxy"):
        assert f"\n    {command} " in result.stdout


@pytest.mark.parametrize(
    ("command", "expected"),
    [
        ("list", ["List every connector", "--json", "(default: tables)", "kvx list --json"]),
        ("validate", ["Check a --kv-transfer-config", "(required)", "exit status: 0 valid"]),
        (
            "demo",
            [
                "Start a prefill engine and a decode engine",
                "(default: 1:1)",
                "(default: 7)",
                "(default: 8)",
                "(default: 16)",
                "one of: ",
                "NHD (default: NHD)",
                "kvx demo --tp 2:1 --layout HND --prompts 3",
                "'{tmp}' in the config's strings",
                "exit status: 0 KV moved",
            ],
        ),
        ("proxy", ["OpenAI-compatible proxy", "(default 8000)", "kvx proxy --prefill http://"]),
    ],
)
def test_command_help_has_description_defaults_choices_and_example(
    command: str, expected: list[str]
) -> None:
    result = kvx(command, "--help")
    assert result.returncode == 0, result.stderr
    text = " ".join(result.stdout.split())  # argparse rewraps help to the terminal width
    for fragment in expected:
        assert " ".join(fragment.split()) in text, (fragment, result.stdout)


def list_in_a_terminal(columns: int) -> str:
    """`kvx list`'s output on a terminal (a pty) `columns` wide (piped output is not wrapped)."""
    leader, follower = pty.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 50, columns, 0, 0))
    env = {**os.environ, "COLUMNS": str(columns), "NO_COLOR": "1", "TERM": "dumb"}
    proc = subprocess.Popen([str(KVX), "list"], stdout=follower, stderr=follower, env=env)
    os.close(follower)
    chunks = []
    try:
        while chunk := os.read(leader, 65536):
            chunks.append(chunk)
    except OSError:  # EIO: the child closed the terminal
        pass
    finally:
        os.close(leader)
    assert proc.wait(timeout=60) == 0, b"".join(chunks).decode()
    return b"".join(chunks).decode().replace("\r\n", "\n")


def test_list_keeps_names_whole_at_80_columns() -> None:
    names = [
        entry["name"]
        for section, entries in json.loads(kvx("list", "--json").stdout).items()
        if section != "plugin_problems"
        for entry in entries
    ]
    assert "kv_postprocess_blksize_and_layout_on_receive" in names  # the longest: 45 characters
    lines = list_in_a_terminal(columns=80).splitlines()
    assert [line for line in lines if len(line) > 80] == []
    words = {word.strip("│┃") for line in lines for word in line.split()}
    assert [name for name in names if name not in words] == []
