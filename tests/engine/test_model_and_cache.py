"""The toy model and the paged KV cache: outputs independent of TP / PP / layout / block size,
exact KV checks, sensitivity to one wrong element, and clear configuration errors."""

from __future__ import annotations

from dataclasses import replace
from functools import cache
from typing import Any

import pytest
import torch

from kvx.engine import Engine, EngineConfig, ToyModel, prefix_hashes
from kvx.engine.kv_cache import rank_heads
from kvx.topology import pp_layer_range

PROMPTS = {
    "a": [(13 * i + 5) % 1000 for i in range(37)],
    "b": [(7 * i + 1) % 1000 for i in range(20)],
}
MAX_TOKENS = 4
BASE = EngineConfig(num_layers=2, num_kv_heads=4, head_size=8, block_size=16, num_blocks=16)


def generate(config: EngineConfig) -> dict[str, list[int]]:
    engine = Engine(config)
    try:
        for rid, prompt in PROMPTS.items():
            engine.add_request(rid, prompt, MAX_TOKENS)
        done: dict[str, list[int]] = {}
        for _ in range(50):
            if not engine.has_pending_work():
                break
            for out in engine.step():
                if out.finished:
                    done[out.request_id] = out.output_token_ids
            assert engine.check_kv() == []
        assert not engine.has_pending_work()
        assert engine.scheduler.pool.num_free_blocks == config.num_blocks
        return done
    finally:
        engine.shutdown()


@cache
def reference(num_kv_heads: int, dtype: str, use_mla: bool) -> dict[str, list[int]]:
    """TP 1, PP 1, NHD, block size 16."""
    out = generate(replace(BASE, num_kv_heads=num_kv_heads, dtype=dtype, use_mla=use_mla))
    assert sorted(out) == ["a", "b"] and all(len(t) == MAX_TOKENS for t in out.values())
    return out


@pytest.mark.parametrize("num_kv_heads", [4, 2])
@pytest.mark.parametrize("tp", [2, 4, 8])
def test_outputs_identical_across_tp(num_kv_heads: int, tp: int) -> None:
    config = replace(BASE, num_kv_heads=num_kv_heads, tp_size=tp)
    assert generate(config) == reference(num_kv_heads, "float32", False)


@pytest.mark.parametrize(("tp", "pp"), [(1, 2), (2, 2)])
def test_outputs_identical_across_pp(tp: int, pp: int) -> None:
    assert generate(replace(BASE, tp_size=tp, pp_size=pp)) == reference(4, "float32", False)


@pytest.mark.parametrize("layout", ["HND", "FLASHINFER_NHD", "FLASHINFER_HND", "CPU_PACKED"])
def test_outputs_identical_across_layouts(layout: str) -> None:
    assert generate(replace(BASE, layout=layout, tp_size=2)) == reference(4, "float32", False)


def test_outputs_identical_across_block_sizes() -> None:
    config = replace(BASE, block_size=32, num_blocks=8)
    assert generate(config) == reference(4, "float32", False)


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_mla_outputs_identical_across_tp(tp: int) -> None:
    if tp == 1:
        assert reference(4, "float32", True) != reference(4, "float32", False)
        return
    config = replace(BASE, use_mla=True, tp_size=tp)
    assert generate(config) == reference(4, "float32", True)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_dtypes_identical_across_tp_pp_layout(dtype: str) -> None:
    ref = reference(4, dtype, False)
    assert generate(replace(BASE, dtype=dtype, tp_size=2, pp_size=2, layout="HND")) == ref
    assert generate(replace(BASE, dtype=dtype, block_size=32, num_blocks=8)) == ref


def test_dtype_and_heads_change_the_model() -> None:
    f32 = reference(4, "float32", False)
    assert reference(4, "bfloat16", False) != f32
    assert reference(2, "float32", False) != f32


def test_cache_tensors_have_the_layout_shape() -> None:
    shapes = {
        "NHD": (2, 16, 16, 2, 8),
        "HND": (2, 16, 16, 2, 8),
        "FLASHINFER_NHD": (16, 2, 16, 2, 8),
        "FLASHINFER_HND": (16, 2, 16, 2, 8),
        "CPU_PACKED": (16, 2, 16, 16),
    }
    for layout, shape in shapes.items():
        engine = Engine(replace(BASE, layout=layout, tp_size=2))
        tensors = engine.workers[1].cache.tensors
        assert list(tensors) == ["model.layers.0.self_attn", "model.layers.1.self_attn"]
        assert all(tuple(t.shape) == shape for t in tensors.values()), layout
    hnd = Engine(replace(BASE, layout="HND")).workers[0].cache.tensors["model.layers.0.self_attn"]
    assert hnd.stride()[3] > hnd.stride()[2]  # heads before tokens in memory
    mla = Engine(replace(BASE, use_mla=True, tp_size=2)).workers[1].cache
    assert tuple(mla.tensors["model.layers.0.self_attn"].shape) == (16, 16, 8)
    assert mla.layout == "MLA"


def test_cpu_packed_cache_stores_k_transposed_like_vllm_cpu() -> None:
    # vLLM-CPU's "vec" kernels: each (block, head) slab is K as [head_size, block_size], then V
    # as [block_size, head_size]; the engine's token writes must land there.
    cache = Engine(replace(BASE, layout="CPU_PACKED")).workers[0].cache
    layer, ids = "model.layers.0.self_attn", [5, 2]
    t = cache.tensors[layer]
    blocks, heads, n, twice = t.shape
    d = twice // 2
    kv = torch.randn(n + 3, 2, heads, d, dtype=t.dtype)
    cache.write(layer, ids, 0, kv)
    slabs = t.reshape(blocks, heads, 2, n * d)
    for pos in range(n + 3):
        b, o = ids[pos // n], pos % n
        assert torch.equal(slabs[b, :, 0].view(heads, d, n)[:, :, o], kv[pos, 0])
        assert torch.equal(slabs[b, :, 1].view(heads, n, d)[:, o], kv[pos, 1])
    assert torch.equal(cache.read(layer, ids, n + 3), kv)
    assert t[[i for i in range(blocks) if i not in ids]].count_nonzero() == 0


# -- exact KV checks and sensitivity ---------------------------------------------------------


def live_engine(**config: Any) -> Engine:
    """An engine that prefilled both prompts and is about to decode."""
    engine = Engine(replace(BASE, **config))
    for rid, prompt in PROMPTS.items():
        engine.add_request(rid, prompt, MAX_TOKENS)
    engine.step()
    assert engine.check_kv() == []
    return engine


def corrupt(
    engine: Engine,
    worker: int,
    layer: str,
    req_id: str,
    pos: int,
    index: int = 0,
    blocks: list[int] | None = None,
) -> None:
    """Move one KV element of `req_id` at token `pos` (`index` into [kv, head, dim]) one ulp
    (in `blocks`, default: the request's live ones)."""
    cache = engine.workers[worker].cache
    table = engine.scheduler.blocks_of(req_id) if blocks is None else blocks
    block = table[pos // cache.block_size]
    view, slot = cache.token_view(layer), (block, pos % cache.block_size)
    token = view[slot]  # a copy for CPU_PACKED (K and V orders differ): written back below
    idx = tuple(int(i) for i in torch.unravel_index(torch.tensor(index), token.shape))
    token[idx] = torch.nextafter(token[idx], torch.tensor(float("inf"), dtype=token.dtype))
    view[slot] = token


LAYER1 = "model.layers.1.self_attn"


@pytest.mark.parametrize("layout", ["NHD", "HND", "FLASHINFER_HND", "CPU_PACKED"])
def test_check_kv_names_worker_layer_request_and_position(layout: str) -> None:
    engine = live_engine(layout=layout, tp_size=2)
    corrupt(engine, 1, LAYER1, "a", 21, index=5)
    assert engine.check_kv() == [
        f"{engine.config.engine_id} worker pp0/tp1 {LAYER1}: request a position 21 (of 37) "
        "differs from what the model wrote"
    ]


def test_check_kv_checks_a_request_finished_in_its_only_step_until_the_next_step() -> None:
    """A prompt prefilled and finished in one step (as on a store connector's P, which holds
    no blocks) is checked after that step: its freed blocks are untouched until the next step
    allocates. Before, such a P's KV was never checked at all."""
    engine = Engine(BASE)
    engine.add_request("a", PROMPTS["a"], 1)
    (out,) = engine.step()
    assert out.finished and engine.check_kv() == []
    corrupt(engine, 0, LAYER1, "a", 21, blocks=engine.scheduler.states["a"].freed_blocks)
    assert engine.check_kv() == [
        f"{engine.config.engine_id} worker pp0/tp0 {LAYER1}: request a position 21 (of 37) "
        "differs from what the model wrote"
    ]
    engine.add_request("b", PROMPTS["b"], 1)
    engine.step()  # allocates: a's freed blocks are no longer its KV to check
    assert engine.check_kv() == []


def test_check_kv_catches_a_corrupted_replica_head() -> None:
    engine = live_engine(num_kv_heads=2, tp_size=4)
    assert [list(w.heads) for w in engine.workers] == [[0], [0], [1], [1]]
    assert [w.cache.primary for w in engine.workers] == [True, False, True, False]
    corrupt(engine, 3, "model.layers.0.self_attn", "b", 0)
    assert engine.check_kv() == [
        f"{engine.config.engine_id} worker pp0/tp3 model.layers.0.self_attn: request b "
        "position 0 (of 20) differs from what the model wrote"
    ]


def test_check_kv_with_pp_names_the_stage() -> None:
    engine = live_engine(pp_size=2, tp_size=2)
    assert [(w.parallel.pp_rank, w.parallel.tp_rank, list(w.layers)) for w in engine.workers] == [
        (0, 0, ["model.layers.0.self_attn"]),
        (0, 1, ["model.layers.0.self_attn"]),
        (1, 0, [LAYER1]),
        (1, 1, [LAYER1]),
    ]
    corrupt(engine, 2, LAYER1, "a", 36)
    assert engine.check_kv() == [
        f"{engine.config.engine_id} worker pp1/tp0 {LAYER1}: request a position 36 (of 37) "
        "differs from what the model wrote"
    ]


@pytest.mark.parametrize(
    ("worker", "layer", "pos", "index"),
    [(0, "model.layers.0.self_attn", 0, 0), (1, LAYER1, 36, 7), (0, LAYER1, 17, 12)],
)
def test_one_wrong_kv_element_changes_the_next_token(
    worker: int, layer: str, pos: int, index: int
) -> None:
    clean, dirty = live_engine(tp_size=2), live_engine(tp_size=2)
    corrupt(dirty, worker, layer, "a", pos, index)
    want = {o.request_id: o.new_token_ids for o in clean.step()}
    got = {o.request_id: o.new_token_ids for o in dirty.step()}
    assert got["b"] == want["b"]
    assert got["a"] != want["a"]


def test_token_kv_is_deterministic() -> None:
    model = ToyModel(2, 4, 8)
    hashes = prefix_hashes(PROMPTS["a"])
    first = model.token_kv(hashes, 1, range(1, 3), torch.float32)
    assert first.shape == (37, 2, 2, 8)
    assert torch.equal(first, model.token_kv(hashes, 1, range(1, 3), torch.float32))
    assert torch.equal(first, ToyModel(2, 4, 8).token_kv(hashes, 1, range(1, 3), torch.float32))
    full = model.token_kv(hashes, 1, range(4), torch.float32)
    assert torch.equal(full[:, :, 1:3], first)  # a head's KV does not depend on the shard
    assert not torch.equal(first, model.token_kv(hashes, 0, range(1, 3), torch.float32))
    assert torch.equal(
        model.token_kv(hashes[:10], 1, range(4), torch.bfloat16), full[:10].to(torch.bfloat16)
    )
    mla = ToyModel(2, 4, 8, use_mla=True).token_kv(hashes, 0, range(2), torch.float32)
    assert mla.shape == (37, 1, 1, 8)


def test_prefix_hashes_chain_over_the_whole_prefix() -> None:
    a = prefix_hashes([1, 2, 3, 4])
    assert a == prefix_hashes([1, 2, 3, 4]) and len(a) == 4
    b = prefix_hashes([1, 2, 9, 4])
    assert a[:2] == b[:2] and a[2] != b[2] and a[3] != b[3]
    assert prefix_hashes([1, 2], seed=1) != a[:2]


def test_rank_heads_and_stage_layers() -> None:
    assert [rank_heads(4, 2, r) for r in range(2)] == [range(0, 2), range(2, 4)]
    assert [rank_heads(2, 8, r) for r in range(8)] == [range(h, h + 1) for h in [0] * 4 + [1] * 4]
    # vLLM's get_pp_indices: the remainder goes to the stages before the last
    assert [pp_layer_range(5, r, 2) for r in range(2)] == [range(0, 3), range(3, 5)]


# -- configuration errors --------------------------------------------------------------------


def test_unknown_layout_names_the_registered_ones() -> None:
    with pytest.raises(ValueError) as info:
        Engine(replace(BASE, layout="NDH"))
    message = str(info.value)
    assert message.startswith(
        "KVCacheSpec.layout: 'NDH' is not a registered layout (did you mean \"NHD\"?); known: "
    )
    assert '"CPU_PACKED"' in message and '"FLASHINFER_HND"' in message
    with pytest.raises(ValueError, match="holds every layer in one tensor"):
        Engine(replace(BASE, layout="CROSS_NHD"))


def test_mla_layout_without_an_mla_model_is_refused_at_build_time() -> None:
    """`layout="MLA"` with `use_mla=False` must not build an engine that breaks on step 1."""
    with pytest.raises(ValueError, match="MLA"):
        engine = Engine(replace(BASE, layout="MLA"))
        engine.add_request("r", PROMPTS["b"], 1)
        engine.step()


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            {"num_kv_heads": 3, "tp_size": 2},
            "tp_size=2 does not divide num_kv_heads=3; use a TP size that divides the heads "
            "([1, 3]) or a multiple of 3 (each rank then holds one replicated head)",
        ),
        (
            {"num_kv_heads": 2, "tp_size": 3},
            "tp_size=3 exceeds num_kv_heads=2 but is not a multiple of it, so heads cannot be "
            "replicated evenly; use a multiple of 2 or a divisor of it ([1, 2])",
        ),
        (
            {"pp_size": 3},
            "EngineConfig.pp_size 3 exceeds num_layers 2: every pipeline stage needs a layer",
        ),
        ({"dtype": "float33"}, "KVCacheSpec.dtype: 'float33' is not a torch dtype name"),
        ({"num_blocks": 0}, "EngineConfig.num_blocks must be a positive integer, got 0"),
        ({"head_size": -1}, "EngineConfig.head_size must be a positive integer, got -1"),
    ],
)
def test_config_errors(change: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError) as info:
        Engine(replace(BASE, **change))
    assert str(info.value) == message
