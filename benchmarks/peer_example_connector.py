"""vLLM's own ExampleConnector class saving and loading a batch of prompts (run in .venv-vllm).

Prints one JSON object: per timed round the save and load CPU time (this process) and wall
time. The connector is vLLM's real class with its real data path (`save_kv_layer`,
`start_load_kv`: one safetensors file per layer and request, slot-mapping gather / scatter);
only its constructor is skipped (it needs a whole VllmConfig for two attributes, set here).
Each layer's cache is the standardized [blocks, heads, tokens, head size] view it is given in
vLLM, K and V heads side by side, bfloat16, twice the blocks saved: loads go into the other
half (the saved blocks stay in place). Loaded bytes are checked after the timed rounds, every
element, a few MiB at a time.

    .venv-vllm/bin/python benchmarks/peer_example_connector.py --layers 8 --block-size 16 \\
        --requests 16 --tokens 256 --repeat 5
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from types import SimpleNamespace
from typing import Any

import torch
from storage_baselines import freeze_startup_heap
from vllm.distributed.kv_transfer.kv_connector.v1.example_connector import (
    ExampleConnector,
    ExampleConnectorMetadata,
)


def main() -> None:
    parser = argparse.ArgumentParser()
    for name in ("layers", "block-size", "requests", "tokens", "repeat"):
        parser.add_argument(f"--{name}", type=int, required=True)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    per_request = args.tokens // args.block_size
    used = args.requests * per_request
    gen = torch.Generator().manual_seed(0)
    shape = (2 * used, 2 * 8, args.block_size, 128)  # blocks, K and V heads, tokens, head size
    names = [f"model.layers.{i}.self_attn" for i in range(args.layers)]
    src = {n: torch.randn(shape, generator=gen, dtype=torch.bfloat16) for n in names}
    order = torch.randperm(2 * used, generator=gen).tolist()
    for layer in src.values():  # the destination blocks start zeroed
        layer.index_fill_(0, torch.tensor(order[used:]), 0)
    root = tempfile.mkdtemp(prefix="kvx-peer-ec-")
    connector = ExampleConnector.__new__(ExampleConnector)
    connector._block_size = args.block_size
    connector._storage_path = root
    forward = SimpleNamespace(
        attn_metadata={n: object() for n in names},
        no_compile_layers={n: SimpleNamespace(kv_cache=src[n]) for n in names},
    )
    times: dict[str, list[float]] = {"save": [], "load": [], "save wall": [], "load wall": []}
    try:
        for round in range(args.repeat + 1):
            if round == 1:
                freeze_startup_heap()
            prompts = [  # one token past the blocks: the last token is never stored
                torch.randint(0, 32000, (args.tokens + 1,), generator=gen).tolist()
                for _ in range(args.requests)
            ]

            def meta(store: bool, ids: list[int], prompts: list[list[int]] = prompts) -> Any:
                out = ExampleConnectorMetadata()
                for r, tokens in enumerate(prompts):
                    blocks = ids[r * per_request : (r + 1) * per_request]
                    out.add_request(tokens, blocks, args.block_size, store, [])
                return out

            save_meta, load_meta = meta(True, order[:used]), meta(False, order[used:])
            start, cpu = time.perf_counter(), time.process_time()
            connector.bind_connector_metadata(save_meta)
            for name in names:
                connector.save_kv_layer(name, src[name], None)
            connector.clear_connector_metadata()
            save = (time.process_time() - cpu, time.perf_counter() - start)
            start, cpu = time.perf_counter(), time.process_time()
            connector.bind_connector_metadata(load_meta)
            connector.start_load_kv(forward)
            connector.clear_connector_metadata()
            load = (time.process_time() - cpu, time.perf_counter() - start)
            if round:  # round 0 warms up
                times["save"].append(save[0])
                times["save wall"].append(save[1])
                times["load"].append(load[0])
                times["load wall"].append(load[1])
            if round < args.repeat:  # the last round's files are checked, then removed
                shutil.rmtree(root)
                root_again = tempfile.mkdtemp(prefix="kvx-peer-ec-")
                connector._storage_path = root = root_again
        per_check = max(1, (8 << 20) // (src[names[0]][0].numel() * 2))  # blocks per 8 MiB
        for at in range(0, used, per_check):
            a = torch.tensor(order[at : min(at + per_check, used)])
            b = torch.tensor(order[used + at : used + min(at + per_check, used)])
            for n in names:
                if not torch.equal(src[n][a].view(torch.int16), src[n][b].view(torch.int16)):
                    raise SystemExit(f"ExampleConnector: loaded bytes of {n} differ")
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(json.dumps(times))


if __name__ == "__main__":
    main()
