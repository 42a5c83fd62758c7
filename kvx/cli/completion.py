"""Shell completion scripts for `kvx` (bash, zsh, fish), generated from its argparse parser:
command names, then each command's flags; other words complete as file names."""

from __future__ import annotations

import argparse

SHELLS = ("bash", "zsh", "fish")


def commands(parser: argparse.ArgumentParser) -> dict[str, list[str]]:
    """Each command of `parser` and its flags (long and short), sorted."""
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return {
        name: sorted({flag for action in command._actions for flag in action.option_strings})
        for name, command in sorted(sub.choices.items())
    }


def script(shell: str, parser: argparse.ArgumentParser) -> str:
    """The completion script for `shell` (one of SHELLS)."""
    table = commands(parser)
    if shell == "fish":
        lines = ["complete -c kvx -f"]
        for name, flags in table.items():
            lines.append(f"complete -c kvx -n __fish_use_subcommand -a {name}")
            for flag in flags:
                option = f"-l {flag[2:]}" if flag.startswith("--") else f"-s {flag[1:]}"
                lines.append(f"complete -c kvx -n '__fish_seen_subcommand_from {name}' {option}")
        return "\n".join(lines) + "\n"
    cases = "\n".join(
        f'        {name}) opts="{" ".join(flags)}" ;;' for name, flags in table.items()
    )
    bash = f"""_kvx() {{
    local cur="${{COMP_WORDS[COMP_CWORD]}}" opts=""
    if [ "$COMP_CWORD" -eq 1 ]; then
        COMPREPLY=($(compgen -W "{" ".join(table)} --help --version" -- "$cur"))
        return
    fi
    case "${{COMP_WORDS[1]}}" in
{cases}
    esac
    if [[ "$cur" == -* ]]; then
        COMPREPLY=($(compgen -W "$opts" -- "$cur"))
    else
        COMPREPLY=($(compgen -f -- "$cur"))
    fi
}}
complete -F _kvx kvx
"""
    if shell == "zsh":
        return "autoload -U +X bashcompinit && bashcompinit\n" + bash
    return bash
