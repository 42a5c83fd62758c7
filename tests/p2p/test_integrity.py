"""Integrity on the wire (`verify_transfers`): P digests every block it hands off, D checks
what landed. A byte flipped for real after P digested it (GET: the send store's copy D reads
from; PUT: P's cache bytes between the save and the send) is caught: the request is recomputed
or failed per `kv_load_failure_policy`, never decoded on wrong KV; with the check off the same
flip lands in D's cache (so the injection is real and the check is what catches it)."""

from __future__ import annotations

import msgspec
import pytest
import torch

import kvx
from kvx.engine.disagg import DisaggregatedPair, pd_configs
from kvx.engine.engine import EngineConfig
from kvx.plugins.p2p.messages import TensorMeta

from ._ports import free_port_range, p2p_config

BASE = EngineConfig(num_layers=2, num_kv_heads=4, head_size=16, block_size=16, num_blocks=64)
PROMPT = list(range(3, 43))  # 40 tokens: 3 blocks


def _corrupt_after_save(pair: DisaggregatedPair, flipped: list[str]) -> None:
    """Flip one byte P hands off after P digested it (once): GET, in the copy P keeps for D
    (after P's step); PUT, in the first slice's bytes between the save and the send."""
    step = pair.prefill.step
    worker = pair.prefill.engine.workers[0].connector.worker  # type: ignore[union-attr]
    flush = worker._flush

    def stepped() -> tuple[list, bool]:
        out = step()
        if not flipped and worker.store is not None and len(worker.store):
            key, item = next(iter(worker.store._items.items()))
            raw = item.tensor.view(-1).view(torch.uint8)
            raw[5] ^= 0x40
            flipped.append(key[1])
        return out

    def flushed() -> None:
        if not flipped and worker._outgoing:
            meta, segments = next(iter(worker._outgoing.values()))[0]
            segments[0][5] ^= 0x40  # the cache's bytes on the CPU plane: P's memory
            flipped.append(meta.layer)
        flush()

    pair.prefill.step = stepped  # type: ignore[method-assign]
    worker._flush = flushed


def _checksum_failures(pair: DisaggregatedPair) -> int:
    stats = pair.decode.engine.kv_stats  # type: ignore[union-attr]
    return sum(s.figures().failures.get("checksum", 0) for s in stats)


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("send_type", "policy", "verify"),
    [
        ("GET", "recompute", True),
        ("GET", "fail", True),
        ("GET", "recompute", False),
        ("PUT", "recompute", True),
        ("PUT", "recompute", False),
    ],
)
def test_a_byte_flipped_after_the_digest_is_caught(
    send_type: str, policy: str, verify: bool
) -> None:
    kv = p2p_config(send_type, free_port_range(4), verify_transfers=verify)
    kv["kv_load_failure_policy"] = policy
    p, d = pd_configs(BASE, kv)
    flipped: list[str] = []
    with DisaggregatedPair(p, d, processes=False) as pair:
        _corrupt_after_save(pair, flipped)
        report = pair.run({"r": PROMPT}, 3, timeout_s=40)
        result = report.results["r"]
        assert flipped, "the injection never ran"
        d_id = str(pair.decode.engine.config.engine_id)  # type: ignore[union-attr]
        on_d = [m for m in report.kv_mismatches if m.startswith(d_id)]
        if not verify:  # the flipped byte reached D's cache: the engine's KV check sees it
            assert on_d, f"the corruption did not land: {report.kv_mismatches}"
            assert _checksum_failures(pair) == 0
            return
        assert _checksum_failures(pair) == 1
        assert on_d == []  # every element of D's KV, the recomputed blocks included
        if send_type == "GET":  # P's own cache was never touched
            assert report.kv_mismatches == []
        if policy == "fail":
            assert result.status == "finished_error"
        else:
            assert result.status == "finished_length_capped"
            assert result.identical, (result.tokens, result.baseline)


@pytest.mark.timeout(90)
@pytest.mark.parametrize(
    ("send_type", "tp", "block_sizes", "layouts"),
    [
        ("PUT", (1, 2), None, ("NHD", "HND")),
        ("PUT_ASYNC", (2, 1), (16, 32), None),
        ("GET", (2, 4), (32, 16), ("HND", "NHD")),  # D GETs a head subset of P's copy
    ],
)
def test_clean_transfers_pass_the_check(
    send_type: str,
    tp: tuple[int, int],
    block_sizes: tuple[int, int] | None,
    layouts: tuple[str, str] | None,
) -> None:
    kv = p2p_config(send_type, free_port_range(8), verify_transfers=True)
    p, d = pd_configs(BASE, kv, tp, block_sizes, layouts)
    with DisaggregatedPair(p, d, processes=False) as pair:
        report = pair.run({"a": PROMPT, "b": PROMPT[:17]}, 3, timeout_s=60)
        assert report.all_identical and report.kv_mismatches == []
        assert _checksum_failures(pair) == 0
        assert report.decode_stats["external_tokens"] >= 40 + 17 - 2  # KV moved


def _meta(**fields: object) -> TensorMeta:
    base: dict[str, object] = {
        "request_id": "r",
        "layer": "l0",
        "src_rank": 0,
        "first_head": 0,
        "num_heads": 4,
        "head_size": 16,
        "block_size": 16,
        "num_blocks": 3,
        "num_tokens": 40,
        "layout": "NHD",
        "dtype": "float16",
        "nbytes": 3 * 16 * 4 * 16 * 2 * 2,
    }
    base.update(fields)
    return msgspec.convert(base, TensorMeta)


def test_a_peer_sends_one_digest_per_block_at_most() -> None:
    assert len(_meta(digests=[1, 2, 3]).digests) == 3
    for digests in ([1, 2], [1, 2, 3, 4], [-1, 0, 0]):
        with pytest.raises((msgspec.ValidationError, ValueError)):
            _meta(digests=digests)
    with pytest.raises(msgspec.ValidationError, match="length"):
        _meta(num_blocks=7000, num_tokens=7000 * 16, digests=[0] * 7000)


def test_digests_name_the_blocks_that_differ_however_the_bytes_are_cut() -> None:
    rows = torch.arange(2 * 4 * 32, dtype=torch.int32).view(torch.uint8).view(2, 4, -1)
    whole = kvx.block_digests([rows.reshape(-1)], 4, outer=2)
    cut = [rows[o, a:b].reshape(-1) for o in range(2) for a, b in ((0, 1), (1, 4))]
    assert kvx.block_digests(cut, 4, outer=2) == whole
    assert kvx.block_digests([bytes(rows.reshape(-1).numpy())], 4, outer=2) == whole
    bad = rows.clone()
    bad[1, 2, 7] ^= 1  # V half of block 2
    got = kvx.block_digests([bad.reshape(-1)], 4, outer=2)
    with pytest.raises(kvx.IntegrityError, match=r"request x: 1 of 4 blocks .*blocks 12\)") as e:
        kvx.check_block_digests("request x", whole, got, [10, 11, 12, 13])
    assert e.value.blocks == [12]
    with pytest.raises(kvx.IntegrityError, match="gave 3 block digests for 4 blocks"):
        kvx.check_block_digests("request x", whole[:3], got)
