"""PP: stage layer ranges (vLLM's split), mapping layers by name between engines with different
PP sizes, and an element-exact transfer between every (pp, tp) worker pair."""

from __future__ import annotations

import itertools
import random
from collections.abc import Callable

import pytest
import torch

from kvx.topology import (
    KVGeometry,
    RankRef,
    TopologyError,
    extract_layer_index,
    layer_sources,
    plan_stage_reads,
    pp_layer_range,
    readers_per_remote_worker,
    stage_layer_names,
)

from ._kv import execute, expected, fill, global_kv, rank_cache

NUM_LAYERS = 6
NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(NUM_LAYERS)]


def test_layer_ranges_match_vllm() -> None:
    assert [pp_layer_range(8, r, 2) for r in range(2)] == [range(0, 4), range(4, 8)]
    # remainder goes to the stages before the last, second-to-last first
    assert [len(pp_layer_range(10, r, 4)) for r in range(4)] == [2, 3, 3, 2]
    assert [len(pp_layer_range(7, r, 3)) for r in range(3)] == [2, 3, 2]
    assert [len(pp_layer_range(6, r, 4)) for r in range(4)] == [1, 2, 2, 1]
    assert [pp_layer_range(6, r, 2, [1, 5]) for r in range(2)] == [range(0, 1), range(1, 6)]
    assert stage_layer_names(NAMES, 1, 2) == NAMES[3:]


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda: pp_layer_range(6, 2, 2), r"pp_rank must be in \[0, 2\)"),
        (lambda: pp_layer_range(6, 0, 2, [1, 2]), "summing to num_layers=6"),
        (lambda: pp_layer_range(2, 0, 4), "smaller than pp_size"),
        (lambda: extract_layer_index("model.layers.x.attn"), "exactly one integer"),
        (lambda: layer_sources(["a.1"], {0: ["a.1"], 1: ["a.1"]}), "exactly one stage"),
        (lambda: layer_sources(["a.1", "b.2"], {0: ["a.1"]}), r"\['b.2'\] are held by no"),
        (
            lambda: plan_stage_reads(
                KVGeometry(1, 1, 16), KVGeometry(1, 1, 16, pp_size=2), RankRef(0, 0), [], {2: []}
            ),
            r"remote PP ranks \[2\] out of range",
        ),
    ],
)
def test_bad_pp_input_says_why(call: Callable[[], object], match: str) -> None:
    with pytest.raises(TopologyError, match=match):
        call()


def _stage_layers(geo: KVGeometry) -> dict[int, list[str]]:
    return {pp: stage_layer_names(NAMES, pp, geo.pp_size) for pp in range(geo.pp_size)}


@pytest.mark.timeout(60)
def test_different_pp_sizes_move_every_element() -> None:
    """P and D with PP 1..4 and several TP/head/MLA pairs: each D worker reads its stage's
    layers by name from whichever P stage holds them; every element of every D worker's
    caches (all its layers) is compared."""
    rng = random.Random(0)
    tp_cases = [(2, 4, 4, False), (4, 1, 2, False), (1, 2, 8, False), (2, 4, 1, True)]
    num_tokens, num_blocks = 40, 8
    for (p_pp, d_pp), (p_tp, d_tp, k, mla) in itertools.product(
        itertools.product((1, 2, 3), (1, 2, 4)), tp_cases
    ):
        layout = "MLA" if mla else "HND"
        p = KVGeometry(p_tp, k, 16, layout, is_mla=mla, pp_size=p_pp)
        d = KVGeometry(d_tp, k, 32, layout, is_mla=mla, pp_size=d_pp)
        kv = {name: global_kv(num_tokens, p) * (i + 1) for i, name in enumerate(NAMES)}
        p_layers, d_layers = _stage_layers(p), _stage_layers(d)
        p_blocks = rng.sample(range(num_blocks), 3)
        p_caches: dict[RankRef, dict[str, torch.Tensor]] = {}
        for pp, tp in itertools.product(range(p_pp), range(p_tp)):
            caches = {}
            for name in p_layers[pp]:
                caches[name] = rank_cache(p, tp, num_blocks)
                fill(p, tp, caches[name], kv[name], p_blocks)
            p_caches[RankRef(pp, tp)] = caches
        seen = dict.fromkeys(p_caches, 0)
        for pp, tp in itertools.product(range(d_pp), range(d_tp)):
            stage = plan_stage_reads(d, p, RankRef(pp, tp), d_layers[pp], p_layers)
            d_blocks = rng.sample(range(num_blocks), 2)
            for target in stage.targets:
                seen[target] += 1
            for src_pp, names in stage.layers_by_stage.items():
                for name in names:
                    remote = [p_caches[RankRef(src_pp, t)].get(name) for t in range(p_tp)]
                    cache = rank_cache(d, tp, num_blocks)
                    execute(stage.plan, remote, cache, p_blocks, d_blocks, num_tokens)
                    want = expected(d, tp, num_blocks, kv[name], d_blocks)
                    assert torch.equal(cache, want), (p, d, pp, tp, name)
            assert sorted(n for ns in stage.layers_by_stage.values() for n in ns) == sorted(
                d_layers[pp]
            )
        assert readers_per_remote_worker(p, d, p_layers, d_layers) == seen
