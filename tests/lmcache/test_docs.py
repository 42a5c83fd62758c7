"""docs/connectors/lmcache.md: every JSON config validates, and every option is documented."""

from __future__ import annotations

import json
import re
from pathlib import Path

from kvx import KVTransferConfig
from kvx.plugins.lmcache.config import LMCacheConfig

DOC = Path(__file__).resolve().parents[2] / "docs" / "connectors" / "lmcache.md"


def test_doc_json_configs_validate() -> None:
    configs = re.findall(r"```json\n(.*?)```", DOC.read_text(), flags=re.S)
    assert len(configs) == 5  # local CPU, local disk, redis://, lm://, and lm:// inside vLLM
    for text in configs:
        data = json.loads(text)
        if data.get("kv_connector_module_path") == "kvx.adapters.vllm":  # vLLM's form: the
            del data["kv_connector_module_path"]  # kvx part is checked here, vLLM's in tests/vllm
        config = KVTransferConfig.from_dict(data)
        assert config.kv_connector == "LMCacheConnectorV1"
        config.extra_config_as(LMCacheConfig)


def test_doc_lists_every_config_key() -> None:
    text = DOC.read_text()
    missing = [key for key in LMCacheConfig.__struct_fields__ if f"| `{key}` |" not in text]
    assert not missing


def test_doc_defaults_are_the_config_defaults() -> None:
    """The table's default column is what an empty extra config gives (the config
    test_conformance.py runs the suite with as "the documented defaults")."""
    rows = re.findall(r"^\| `(\w+)` \| [^|]+ \| ([^|]+) \|", DOC.read_text(), flags=re.M)
    documented = {key: cell.strip().strip("`") for key, cell in rows}
    defaults = LMCacheConfig()
    for key in LMCacheConfig.__struct_fields__:
        cell = documented[key]
        want = None if cell == "—" else json.loads(cell)
        assert getattr(defaults, key) == want, (key, cell)
