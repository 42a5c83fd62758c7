"""`kvx completion SHELL`: a script generated from the parser that really completes commands
and their flags in bash (run here); zsh loads the same through bashcompinit, fish gets its own
`complete` lines; an unknown shell is a usage error (exit 2) naming the choices."""

from __future__ import annotations

import subprocess

import pytest

from kvx.cli.commands import main

pytestmark = pytest.mark.timeout(60)


def complete(script: str, *words: str) -> list[str]:
    """What bash offers for the last of `words` after loading `script`."""
    line = " ".join(f"'{w}'" for w in ("kvx", *words))
    run = subprocess.run(
        [
            "bash",
            "-c",
            f"{script}\nCOMP_WORDS=({line}); COMP_CWORD={len(words)}; _kvx; "
            'printf "%s\\n" "${COMPREPLY[@]}"',
        ],
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    )
    return run.stdout.split()


def test_bash_completes_commands_and_each_commands_flags(capsys) -> None:
    assert main(["completion", "bash"]) == 0
    script = capsys.readouterr().out
    assert complete(script, "val") == ["validate"]
    assert set(complete(script, "")) >= {"list", "validate", "demo", "proxy", "completion"}
    assert complete(script, "validate", "--kv-tr") == ["--kv-transfer-config"]
    assert "--prefill" in complete(script, "proxy", "--pre")
    assert complete(script, "list", "--kv-tr") == []  # validate's flag is not list's


def test_zsh_and_fish_scripts(capsys) -> None:
    assert main(["completion", "zsh"]) == 0
    zsh = capsys.readouterr().out
    assert zsh.startswith("autoload -U +X bashcompinit && bashcompinit\n")
    assert "complete -F _kvx kvx" in zsh
    assert main(["completion", "fish"]) == 0
    fish = capsys.readouterr().out
    assert "complete -c kvx -n __fish_use_subcommand -a validate" in fish
    assert "complete -c kvx -n '__fish_seen_subcommand_from validate' -l kv-transfer-config" in fish


def test_an_unknown_shell_is_a_usage_error(capsys) -> None:
    assert main(["completion", "tcsh"]) == 2
    assert "invalid choice: 'tcsh' (choose from 'bash', 'zsh', 'fish')" in capsys.readouterr().err
