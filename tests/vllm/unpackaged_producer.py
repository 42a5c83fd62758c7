"""A prefill engine (P) running an unpackaged kvx connector in a multiprocess vLLM-CPU engine,
for test_connector_forms_in_vllm.py: run as a child process with the connector's source
directory on PYTHONPATH (nothing installed). vLLM's engine core runs in a spawned process that
finds the connector only through PYTHONPATH and kvx's vLLM plugin.

Usage: python unpackaged_producer.py WORK_DIR. Reads WORK_DIR/job.json (model, engine options,
prompts, P's `--kv-transfer-config` JSON, its hand-off directory); P prefills each prompt with
`do_remote_decode`, waits until its hand-off files exist and shuts down. Writes
WORK_DIR/result.json: P's first tokens, the `kv_transfer_params` D needs, and where the
connector's module was imported from.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import vllm
from vllm.config import KVTransferConfig
from vllm.inputs import TokensPrompt

HANDOFF_WAIT_S = 60.0


def prefill(job: dict[str, Any]) -> Any:
    """P's outputs for the job's prompts, once its hand-off files are written."""
    llm = vllm.LLM(
        model=job["model"], kv_transfer_config=KVTransferConfig(**job["p_kv"]), **job["options"]
    )
    try:
        decode_elsewhere = {"kv_transfer_params": {"do_remote_decode": True}}
        sampling = vllm.SamplingParams(max_tokens=1, temperature=0.0, extra_args=decode_elsewhere)
        prompts = [TokensPrompt(prompt_token_ids=p) for p in job["prompts"]]
        outputs = llm.generate(prompts, sampling, use_tqdm=False)
        wait_for_handoff(Path(job["p_dir"]), [o.kv_transfer_params for o in outputs])
        return outputs
    finally:
        llm.llm_engine.engine_core.shutdown()


def wait_for_handoff(root: Path, params: list[dict[str, Any]]) -> None:
    """P's workers write the files after `generate` returned; wait for every one."""
    files = [root / p["remote_engine_id"] / p["remote_request_id"] / "pp0_tp0.kv" for p in params]
    deadline = time.monotonic() + HANDOFF_WAIT_S
    while not all(f.exists() for f in files):
        if time.monotonic() > deadline:
            missing = [str(f) for f in files if not f.exists()]
            raise TimeoutError(f"P wrote no hand-off file {missing} in {HANDOFF_WAIT_S}s")
        time.sleep(0.05)


def main(work: Path) -> int:
    job = json.loads((work / "job.json").read_text())
    outputs = prefill(job)
    module = sys.modules.get(job["module"])  # imported by vLLM's factory in this process too
    result = {
        "module_file": getattr(module, "__file__", None),
        "tokens": [list(o.outputs[0].token_ids) for o in outputs],
        "params": [o.kv_transfer_params for o in outputs],
    }
    (work / "result.json").write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1])))
