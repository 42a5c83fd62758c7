"""Every --kv-transfer-config in docs/ and the README passes `kvx validate` as written; those
marked `<!-- kvx: local -->` (docs/config.md) also move KV through `kvx demo` on this machine.

Configs written for vLLM name `"kv_connector_module_path": "kvx.adapters.vllm"` or a
`"kvx.<name>"` connector (kvx's vLLM plugin), which need vLLM; this venv has none, so their kvx
part is validated here (the same connector and extra config) and the vLLM forms in tests/vllm."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from kvx.cli.commands import main as kvx_main
from kvx.config.transfer import MAX_JSON_DEPTH
from kvx.config.yaml_files import parse_yaml

ROOT = Path(__file__).resolve().parents[2]
KVX = Path(sys.executable).parent / "kvx"
LOCAL_MARKER = "<!-- kvx: local -->"
CONFIG_BLOCK = re.compile(r"^```(json|yaml)\n(.*?)^```", re.MULTILINE | re.DOTALL)


def doc_configs() -> list[tuple[str, str, bool]]:
    """(where, JSON text, marked local) of every JSON or YAML block naming a `kv_connector`
    (a YAML block as the JSON kvx reads from it)."""
    found = []
    for path in sorted([ROOT / "README.md", *(ROOT / "docs").rglob("*.md")]):
        text = path.read_text()
        for match in CONFIG_BLOCK.finditer(text):
            language, block = match.groups()
            names = '"kv_connector"' in block if language == "json" else "kv_connector:" in block
            if not names:
                continue
            line = text.count("\n", 0, match.start()) + 1
            before = text[: match.start()].rstrip("\n").rsplit("\n", 1)[-1]
            where = f"{path.relative_to(ROOT)}:{line}"
            if language == "yaml":
                block = json.dumps(parse_yaml(block, where, MAX_JSON_DEPTH))
            found.append((where, block, before.strip() == LOCAL_MARKER))
    return found


VLLM_ADAPTER = "kvx.adapters.vllm"


def without_vllm_adapter(value: object) -> object:
    """The config as kvx names it: no `kv_connector_module_path` of kvx's vLLM adapter, and
    `"kvx.<name>"` connectors (kvx's vLLM plugin) as `"<name>"`."""
    if isinstance(value, list):
        return [without_vllm_adapter(v) for v in value]
    if isinstance(value, dict):
        kept = {
            k: without_vllm_adapter(v)
            for k, v in value.items()
            if not (k == "kv_connector_module_path" and v == VLLM_ADAPTER)
        }
        name = kept.get("kv_connector")
        if isinstance(name, str) and name.startswith("kvx."):
            kept["kv_connector"] = name.removeprefix("kvx.")
        return kept
    return value


CONFIGS = doc_configs()
LOCAL = [(where, text) for where, text, local in CONFIGS if local]


def test_the_docs_have_configs_and_local_ones() -> None:
    assert len(CONFIGS) >= 8
    assert {where.split(":")[0] for where, _ in LOCAL} >= {
        "docs/connectors/shared-storage.md",
        "docs/connectors/nixl.md",
    }


@pytest.mark.parametrize(
    ("where", "text"), [(w, t) for w, t, _ in CONFIGS], ids=[w for w, _, _ in CONFIGS]
)
def test_doc_config_validates(where: str, text: str, capsys: pytest.CaptureFixture[str]) -> None:
    config = json.loads(text)  # a kv-transfer-config in the docs is JSON as written
    assert isinstance(config, dict) and "kv_connector" in config, where
    code = kvx_main(["validate", "--kv-transfer-config", json.dumps(without_vllm_adapter(config))])
    captured = capsys.readouterr()
    assert code == 0, f"{where}: {captured.out}{captured.err}"


@pytest.mark.timeout(150)
@pytest.mark.parametrize(("where", "text"), LOCAL, ids=[w for w, _ in LOCAL])
def test_local_doc_config_moves_kv_in_the_demo(where: str, text: str, tmp_path: Path) -> None:
    result = subprocess.run(
        [str(KVX), "demo", "--kv-transfer-config", text, "--prompts", "3", "--max-tokens", "2"],
        capture_output=True,
        text=True,
        timeout=140,
        cwd=tmp_path,
        env={**os.environ, "COLUMNS": "120", "NO_COLOR": "1", "TERM": "dumb"},
        check=False,
    )
    assert result.returncode == 0, f"{where}:\n{result.stdout}{result.stderr}"
    (moved,) = [line for line in result.stdout.splitlines() if line.startswith("│ KV blocks moved")]
    assert int(moved.split("│")[-2]) > 0, result.stdout
    assert list(tmp_path.iterdir()) == []  # nothing created where it ran
