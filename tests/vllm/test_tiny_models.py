"""`kvx tiny-model`: every shape builds offline into a model directory transformers reads."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kvx.adapters.tiny_models import SHAPES

ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen3-gqa1": "Qwen3ForCausalLM",
    "mistral-sw": "MistralForCausalLM",
    "qwen2-sw": "Qwen2ForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
    "deepseek-v2-mla": "DeepseekV2ForCausalLM",
    "granite4h": "GraniteMoeHybridForCausalLM",
    "falcon-h1": "FalconH1ForCausalLM",
    "qwen3-next": "Qwen3NextForCausalLM",
}


KVX = shutil.which("kvx", path=str(Path(sys.executable).parent))


def kvx(*args: str) -> subprocess.CompletedProcess[str]:
    assert KVX is not None, "the kvx console script is not installed beside this Python"
    return subprocess.run([KVX, *args], capture_output=True, text=True, timeout=300, check=False)


def test_every_shape_is_tested() -> None:
    assert set(ARCHITECTURES) == set(SHAPES)


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_the_command_builds_each_shape(shape: str, tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    done = kvx("tiny-model", shape, str(tmp_path / shape), "--positions", "1024")
    assert done.returncode == 0, done.stderr
    config = json.loads((tmp_path / shape / "config.json").read_text())
    assert config["architectures"] == [ARCHITECTURES[shape]]
    assert config["max_position_embeddings"] == 1024
    assert config["dtype"] == SHAPES[shape][1]
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / shape)
    assert len(tokenizer) == 512
    assert any((tmp_path / shape).glob("*.safetensors"))


def test_an_unknown_shape_is_refused_naming_the_shapes(tmp_path: Path) -> None:
    done = kvx("tiny-model", "mistral", str(tmp_path / "m"))
    assert done.returncode == 2
    assert "SHAPE 'mistral' is not allowed" in done.stderr
    assert "mistral-sw" in done.stderr
    assert not (tmp_path / "m").exists()
