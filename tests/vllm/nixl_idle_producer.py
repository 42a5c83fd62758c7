"""A NIXL prefill engine (vLLM-CPU, in-process) that goes idle after its prefills, for
test_nixl_failures_in_vllm.py, run as a child process.

Usage: python nixl_idle_producer.py MODEL_DIR WORK_DIR. Prefills each prompt of
WORK_DIR/prompts.json with `do_remote_decode`, writes the KV of the blocks it hands off (raw
float32 per layer), takes the one step after the prefills that starts its workers' leases (a
serving engine always takes it: it still holds the requests), writes WORK_DIR/params.json and
then never steps again: nothing but the connector's own progress thread serves D's READs. It
exits when killed, or after 300 s (exit 3).
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

NIXL = {
    "kv_connector": "NixlConnector",
    "kv_connector_module_path": "kvx.adapters.vllm",
    "kv_role": "kv_producer",
    "kv_connector_extra_config": {"required_layout": None, "kv_lease_duration": 300},
}


def main(model: str, work: Path) -> int:
    prompts = json.loads((work / "prompts.json").read_text())
    llm = vllm.LLM(model=model, kv_transfer_config=KVTransferConfig(**NIXL), **ENGINE_OPTIONS)
    decode_elsewhere = {"kv_transfer_params": {"do_remote_decode": True}}
    params = vllm.SamplingParams(max_tokens=1, temperature=0.0, extra_args=decode_elsewhere)
    outputs = llm.generate(
        [TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False
    )
    layers = llm.llm_engine.vllm_config.compilation_config.static_forward_context
    for i, out in enumerate(outputs):
        blocks = out.kv_transfer_params["remote_block_ids"]
        for name, layer in layers.items():
            if hasattr(layer, "kv_cache"):
                layer.kv_cache[blocks].numpy().tofile(work / f"p{i}.{name}.f32")
    llm.llm_engine.step()  # hands the finished requests' leases to the worker
    result = [{"params": o.kv_transfer_params} for o in outputs]
    tmp = work / "params.json.tmp"
    tmp.write_text(json.dumps(result))
    tmp.rename(work / "params.json")
    time.sleep(300)  # idle: the engine is never stepped again
    return 3


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], Path(sys.argv[2])))
