"""Integrity on the wire for NIXL pull and push (`verify_transfers`), real NIXL/UCX: a byte of
P's KV flipped for real after P digested the hand-off and before D reads it (pull) or P writes
it into D's blocks (push) is caught, and the request is recomputed or failed per
`kv_load_failure_policy`, never decoded on wrong KV; with the check off the same flip lands in
D's cache (the injection is real; the check is what catches it)."""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch
import zmq

import kvx
from kvx.engine.disagg import DisaggregatedPair, pd_configs
from kvx.engine.engine import EngineConfig
from kvx.plugins.nixl.handshake import HandshakeError
from kvx.plugins.nixl.integrity import PartDigests, fetch_digests
from kvx.plugins.nixl.side_channel import SideChannelServer

BASE = EngineConfig(num_layers=2, num_kv_heads=4, head_size=16, block_size=16, num_blocks=64)
PROMPT = list(range(3, 43))  # 40 tokens: 3 blocks
POLICIES = [("recompute", True), ("fail", True), ("recompute", False)]


def _flip_after_digest(pair: DisaggregatedPair, flipped: list[int], head: int = 0) -> None:
    """When P's worker has taken the hand-off (and digested it, with the check on), flip one
    byte of head `head` (of P's worker 0's) of the request's second block in P's KV cache
    (once), before D reads it (pull) or registers its blocks for P to write (push)."""
    engine = pair.prefill.engine  # type: ignore[union-attr]
    scheduler = engine.scheduler_connector.scheduler
    worker = engine.workers[0].connector.worker
    blocks: dict[str, list[int]] = {}
    finish, start = scheduler.request_finished, worker._start_load_kv

    def finished(request: Any, block_ids: list[int]) -> Any:
        delay, params = finish(request, block_ids)
        if params:
            blocks[request.request_id] = params["remote_block_ids"]
        return delay, params

    def started(meta: Any) -> None:
        start(meta)
        for req_id in meta.reqs_to_send:
            if not flipped:
                block = blocks[req_id][1]
                layer = next(reversed(worker._caches.values()))
                physical = layer.permute(worker.layout.stride_order)
                rows = physical.reshape(2, physical.shape[1], -1).view(torch.uint8)
                at = head * rows.shape[-1] // worker.heads + 3  # the layout puts heads first
                rows[1, block, at] ^= 0x10  # last layer, V half, P's memory
                flipped.append(block)

    scheduler.request_finished = finished
    worker._start_load_kv = started
    # D steps only once the byte is flipped: P's params reach D in the round P finished the
    # prompt, a step before P's worker takes the hand-off, and a READ (or registration) D
    # made in between would race the flip
    d_step = pair.decode.step
    pair.decode.step = lambda: d_step() if flipped else ([], True)  # type: ignore[method-assign]


def _stats(pair: DisaggregatedPair, kind: str) -> int:
    stats = pair.decode.engine.kv_stats  # type: ignore[union-attr]
    return sum(s.figures().failures.get(kind, 0) for s in stats)


def _count_by_rank(pair: DisaggregatedPair) -> list[str]:
    """Record `tp<rank>:<counter>` for every counter D's workers bump (stats are summed over
    the workers before the engine sees them: this says which worker caught what)."""
    seen: list[str] = []
    for rank, w in enumerate(pair.decode.engine.workers):  # type: ignore[union-attr]
        stats = w.connector.worker.stats
        count = stats.count

        def counted(key: str, n: int = 1, rank: int = rank, count: Any = count) -> None:
            seen.append(f"tp{rank}:{key}")
            count(key, n)

        stats.count = counted
    return seen


PULL, PUSH = "NixlConnector", "NixlPushConnector"
MODES = {PULL: "pull", PUSH: "push"}
FLIPS = [
    *((c, (1, 1), policy, verify, 0) for c in (PULL, PUSH) for policy, verify in POLICIES),
    # D's blocks from two P ranks, P rank 0's part flipped
    *((c, (2, 1), "recompute", True, 0) for c in (PULL, PUSH)),
    # each D rank holds half of P's heads: the flip in head 0 is D rank 0's to catch, the flip
    # in head 3 D rank 1's
    *((c, (1, 2), policy, verify, 0) for c in (PULL, PUSH) for policy, verify in POLICIES),
    *((c, (1, 2), "recompute", True, 3) for c in (PULL, PUSH)),
]


@pytest.mark.timeout(90)
@pytest.mark.parametrize(
    ("connector", "tp", "policy", "verify", "head"),
    FLIPS,
    ids=[
        f"{MODES[c]}-{t[0]}to{t[1]}-{p}-{'on' if v else 'off'}-head{h}" for c, t, p, v, h in FLIPS
    ],
)
def test_a_byte_flipped_after_the_digest_is_caught(
    connector: str, tp: tuple[int, int], policy: str, verify: bool, head: int
) -> None:
    kv = {
        "kv_connector": connector,
        "kv_load_failure_policy": policy,
        "kv_connector_extra_config": {"transfer_timeout_s": 10, "verify_transfers": verify},
    }
    p, d = pd_configs(BASE, kv, tp)
    flipped: list[int] = []
    with DisaggregatedPair(p, d, processes=False, timeout_s=60) as pair:
        _flip_after_digest(pair, flipped, head)
        seen = _count_by_rank(pair)
        report = pair.run({"r": PROMPT}, 3, timeout_s=60)
        assert flipped, "the injection never ran"
        d_id = str(pair.decode.engine.config.engine_id)  # type: ignore[union-attr]
        on_d = [m for m in report.kv_mismatches if m.startswith(d_id)]
        result = report.results["r"]
        if not verify:  # the flipped byte reached D's cache: the engine's KV check sees it
            assert on_d, f"the corruption did not land: {report.kv_mismatches}"
            assert _stats(pair, "checksum") == 0
            return
        assert on_d == []  # every element of D's KV, the recomputed blocks included
        assert _stats(pair, "checksum") == 1
        # only the D worker holding the flipped head caught it (P worker 0's head `head`)
        catcher = head // (BASE.num_kv_heads // tp[1])
        assert [k for k in seen if k.endswith("checksum_failures")] == [
            f"tp{catcher}:num_checksum_failures"
        ]
        if policy == "fail":
            assert result.status == "finished_error"
        else:
            assert result.status == "finished_length_capped"
            assert result.identical, (result.tokens, result.baseline)


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("connector", "tp"),
    [
        ("NixlConnector", (1, 1)),
        ("NixlConnector", (2, 2)),
        ("NixlConnector", (2, 1)),  # each P rank's blocks land in a head range of D's
        ("NixlConnector", (1, 2)),  # each D rank reads, and checks, half of P's heads
        ("NixlPushConnector", (2, 2)),
        ("NixlPushConnector", (2, 1)),
        ("NixlPushConnector", (1, 2)),  # each D rank gets, and checks, half of P's heads
        ("NixlConnector", (2, 4)),  # each D rank reads one of a P rank's two heads
        ("NixlPushConnector", (2, 4)),
    ],
)
def test_clean_reads_pass_the_check(
    connector: str, tp: tuple[int, int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every read is checked (per request, D rank and P rank it got heads from) and passes."""
    kv = {
        "kv_connector": connector,
        "kv_connector_extra_config": {"transfer_timeout_s": 10, "verify_transfers": True},
    }
    checked: list[str] = []
    check = kvx.check_block_digests

    def counted(what: str, *args: Any) -> None:
        checked.append(what.split()[1])
        check(what, *args)

    monkeypatch.setattr(kvx, "check_block_digests", counted)
    p, d = pd_configs(BASE, kv, tp)
    with DisaggregatedPair(p, d, processes=False, timeout_s=60) as pair:
        report = pair.run({"a": PROMPT, "b": PROMPT[:17]}, 3, timeout_s=90)
        assert report.all_identical and report.kv_mismatches == []
        assert _stats(pair, "checksum") == 0
        assert _stats(pair, "transport") == 0
    # with hetero TP each request has max(P's, D's) (D rank, P rank) pairs to check
    assert sorted(checked) == sorted(["a", "b"] * max(tp))


@pytest.mark.timeout(30)
def test_digests_are_served_sealed_and_a_wrong_count_is_refused() -> None:
    """P's side channel serves a hand-off's digests of the heads D names, merged per block, to
    a D with the secret; it refuses heads its worker did not digest (an untrusted peer), D
    refuses a reply whose count is not the request's blocks, and gives up on digests P never
    had at its deadline."""
    secret = "integrity-secret-0123"
    server = SideChannelServer("127.0.0.1", 0, "hash", {}, {}, secret)
    context = zmq.Context()
    try:
        parts = list(range(7, 19))  # 3 blocks x 4 heads
        server.digests.put({("r", 0, 0): PartDigests(1, 4, parts)})

        def fetch(
            key: tuple[str, int, int],
            count: int,
            heads: tuple[int, int] = (0, 4),
            wait_s: float = 5,
        ) -> list[int]:
            deadline = time.monotonic() + wait_s
            return fetch_digests(
                "127.0.0.1",
                server.port,
                key,
                heads,
                deadline=deadline,
                secret=secret,
                count=count,
                context=context,
            )

        assert fetch(("r", 0, 0), 3) == kvx.merge_digests(parts, 4, 0, 4)
        assert fetch(("r", 0, 0), 3, (2, 2)) == kvx.merge_digests(parts, 4, 2, 2)
        with pytest.raises(HandshakeError, match="3 digests, not 2"):
            fetch(("r", 0, 0), 2)
        with pytest.raises(
            HandshakeError, match=r"heads 3\.\.4 of worker tp0: it digested heads 0\.\.3"
        ):
            fetch(("r", 0, 0), 3, (3, 2))
        start = time.monotonic()
        with pytest.raises(HandshakeError, match=r"pending|no reply"):
            fetch(("never", 0, 0), 3, wait_s=0.5)
        assert time.monotonic() - start < 3
    finally:
        context.term()
        server.close()
