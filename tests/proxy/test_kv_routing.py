"""KV-aware routing: the prefix index (bounds, eviction, lost events), the KV events as vLLM
publishes them (ZMQ PUB, msgpack; untrusted), and the proxy routing P to the server holding a
prompt's prefix, by load otherwise. Real ZMQ sockets and stub servers on loopback; the real
engines' prefix hits are tests/vllm/serving/test_kv_aware_serving.py's job."""

from __future__ import annotations

import pickle
import threading
import time

import msgspec
import pytest
import zmq

from kvx.proxy import ProxyConfig, ProxySettingError
from kvx.proxy.kv_events import MAX_BLOCKS_PER_EVENT, KvEventListener
from kvx.proxy.pool import Role, Upstream
from kvx.proxy.prefix_index import PrefixIndex, chain_keys
from kvx.proxy.routing import KvAware, RouteHint

pytestmark = pytest.mark.timeout(60)

BS = 4  # block size of the made-up engines


def stored(hashes, parent, tokens, block_size=BS):
    """A BlockStored event as vLLM 0.32 encodes it (a map tagged by `type`)."""
    return {
        "type": "BlockStored",
        "block_hashes": hashes,
        "parent_block_hash": parent,
        "token_ids": tokens,
        "block_size": block_size,
        "lora_id": None,
        "medium": "GPU",
        "lora_name": None,
    }


def removed(hashes):
    return {"type": "BlockRemoved", "block_hashes": hashes, "medium": "GPU"}


def frames(seq: int, *events) -> list[bytes]:
    """One message of vLLM's ZmqEventPublisher: topic, sequence, msgpack [ts, events, rank]."""
    payload = msgspec.msgpack.encode([time.time(), list(events), None])
    return [b"", seq.to_bytes(8, "big"), payload]


PROMPT = list(range(100, 112))  # three blocks of 4
KEYS = chain_keys(PROMPT, BS, 100)


def test_index_matches_the_longest_held_prefix_and_nothing_past_a_gap():
    index = PrefixIndex(max_blocks=100)
    index.stored("A", [b"a1", b"a2"], None, PROMPT[:8], BS)
    index.stored("B", [11], None, PROMPT[:4], BS)
    index.stored("B", [13], 12, PROMPT[8:12], BS)  # parent 12 never stored: not indexed
    assert (index.matched("A", KEYS), index.matched("B", KEYS)) == (2, 1)
    assert index.counts.orphaned == 1
    other = chain_keys([7, *PROMPT[1:]], BS, 100)  # differs in the first token: no block
    assert index.matched("A", other) == 0
    # the same tokens after a different prefix key differently
    assert chain_keys(PROMPT[4:8], BS, 1) != KEYS[1:2]


def test_index_removes_clears_and_evicts_the_least_recently_stored():
    index = PrefixIndex(max_blocks=3)
    index.stored("A", [1, 2, 3], None, PROMPT, BS)
    index.removed("A", [3])
    assert index.matched("A", KEYS) == 2
    index.removed("A", [3, 99])  # unknown hashes are ignored
    assert index.counts.removed == 1
    index.stored("A", [3], 2, PROMPT[8:12], BS)
    index.stored("A", [4], None, [1, 2, 3, 4], BS)  # a fourth block: block 1 is evicted
    assert index.blocks("A") == 3 and index.counts.evicted == 1
    assert index.matched("A", KEYS) == 0  # the prefix starts with the evicted block
    index.cleared("A")
    assert index.blocks("A") == 0 and index.block_size("A") is None


def test_index_forgets_blocks_of_another_block_size():
    index = PrefixIndex(max_blocks=100)
    index.stored("A", [1], None, PROMPT[:4], BS)
    index.stored("A", [2], None, PROMPT[:8], 8)
    assert index.block_size("A") == 8 and index.blocks("A") == 1
    assert index.matched("A", chain_keys(PROMPT, 8, 100)) == 1


def test_listener_applies_vllm_batches_counts_lost_and_restarts():
    index = PrefixIndex(max_blocks=100)
    listener = KvEventListener((), index)
    try:
        listener.handle("A", frames(0, stored([1, 2], None, PROMPT[:8])))
        listener.handle("A", frames(1, stored([3], 2, PROMPT[8:])))
        assert index.matched("A", KEYS) == 3
        listener.handle("A", frames(4, removed([3])))  # batches 2 and 3 were lost
        assert listener.counts.lost == 2 and index.matched("A", KEYS) == 2
        listener.handle("A", frames(5, {"type": "AllBlocksCleared"}))
        assert index.blocks("A") == 0
        listener.handle("A", frames(6, stored([1], None, PROMPT[:4])))
        listener.handle("A", frames(0, stored([9], None, [5, 5, 5, 5])))  # the engine restarted
        assert listener.counts.restarts == 1
        assert index.matched("A", KEYS) == 0 and index.blocks("A") == 1
        assert listener.counts.batches == 6 and listener.counts.refused == 0
    finally:
        listener.stop()


@pytest.mark.parametrize(
    "message",
    [
        [b"", (0).to_bytes(8, "big")],  # two frames
        [b"", b"\x00", msgspec.msgpack.encode([0.0, [], None])],  # sequence not 8 bytes
        [b"", (0).to_bytes(8, "big"), pickle.dumps({"type": "BlockStored"})],  # pickle
        frames(0, stored([1], None, [1, 2, 3])),  # 3 token ids for one block of 4
        frames(0, stored([1], None, [1, 2, 3, -4])),  # a negative token id
        frames(0, stored([1], None, [1] * 8192, block_size=8192)),  # block size over 4096
        frames(0, stored([b"x" * 65], None, [1, 2, 3, 4])),  # a hash of 65 bytes
        frames(0, removed(list(range(MAX_BLOCKS_PER_EVENT + 1)))),  # too many blocks
        frames(0, {"type": "Unknown"}),
        frames(0, {"type": "BlockRemoved"}),  # no block_hashes
    ],
)
def test_listener_refuses_malformed_messages_and_keeps_the_index(message):
    index = PrefixIndex(max_blocks=100)
    listener = KvEventListener((), index)
    try:
        listener.handle("A", frames(0, stored([1], None, PROMPT[:4])))
        listener.handle("A", message)
        assert listener.counts.refused == 1
        assert index.matched("A", KEYS) == 1
    finally:
        listener.stop()


def servers(*names: str) -> list[Upstream]:
    return [Upstream(n, Role.PREFILL) for n in names]


def test_kv_aware_router_prefers_the_longest_prefix_then_load():
    index = PrefixIndex(max_blocks=100)
    router = KvAware(index)
    a, b, c = servers("A", "B", "C")
    index.stored("B", [1], None, PROMPT[:4], BS)
    index.stored("C", [1, 2], None, PROMPT[:8], BS)
    hint = RouteHint(PROMPT)
    assert router.choose([a, b, c], hint) is c
    c.outstanding = 5  # much busier than A: the prefix is not worth the queue
    assert router.choose([a, b, c], hint) is b
    assert router.choose([a, b, c], RouteHint([1, 2, 3, 4])) in (a, b)  # nobody holds it: load
    assert router.choose([a, b, c], None) in (a, b)
    assert router.routed == 2


def test_kv_aware_needs_kv_events_and_they_need_it():
    with pytest.raises(ProxySettingError, match="--kv-events: --routing kv_aware needs"):
        ProxyConfig(routing="kv_aware")
    with pytest.raises(ProxySettingError, match="only used with --routing kv_aware"):
        ProxyConfig(kv_events=("http://127.0.0.1:8100=tcp://127.0.0.1:5557",))
    with pytest.raises(ProxySettingError, match="must be tcp://HOST:PORT or ipc://PATH"):
        ProxyConfig(routing="kv_aware", kv_events=("http://127.0.0.1:8100=udp://x:1",))
    with pytest.raises(ProxySettingError, match="expected SERVER_URL=ENDPOINT"):
        ProxyConfig(routing="kv_aware", kv_events=("tcp://127.0.0.1:5557",))
    with pytest.raises(ProxySettingError, match="--kv-index-blocks"):
        ProxyConfig(routing="kv_aware", kv_events=("http://a:1=tcp://a:2",), kv_index_blocks=0)


class Publisher:
    """A ZMQ PUB socket publishing as vLLM's ZmqEventPublisher does."""

    def __init__(self, endpoint: str) -> None:
        self.context = zmq.Context()
        self.sock = self.context.socket(zmq.PUB)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind(endpoint)
        self.seq = 0
        self.lock = threading.Lock()

    def publish(self, *events) -> None:
        with self.lock:
            self.sock.send_multipart(frames(self.seq, *events))
            self.seq += 1

    def close(self) -> None:
        self.sock.close(linger=0)
        self.context.term()


def test_proxy_routes_prefill_to_the_server_holding_the_prefix(
    stub, start_proxy, client, wait_until, tmp_path
):
    p1, p2, d = stub("P1"), stub("P2"), stub("D")
    endpoint = f"ipc://{tmp_path}/p2-events"
    publisher = Publisher(endpoint)
    try:
        proxy = start_proxy(
            [p1.url, p2.url],
            [d.url],
            routing="kv_aware",
            kv_events=(f"{p2.url}={endpoint}",),
        )
        prompt = "shared system prompt, then a question"
        tokens = [ord(c) for c in prompt]  # the stub's /tokenize
        blocks = len(tokens) // BS

        def indexed() -> bool:  # ZMQ's slow joiner: publish until the proxy has it
            publisher.seq = 0
            publisher.publish(stored(list(range(blocks)), None, tokens[: blocks * BS]))
            kv = client.get(f"{proxy.url}/kvx/servers").json()["kv_index"]
            return kv["blocks"][p2.url] == blocks

        wait_until(indexed, 10, "the proxy to index P2's blocks")
        body = {"model": "tiny", "prompt": prompt, "max_tokens": 2}
        answers = [client.post(f"{proxy.url}/v1/completions", json=body) for _ in range(4)]
        assert [a.status_code for a in answers] == [200] * 4
        assert {a.headers["x-kvx-prefill"] for a in answers} == {p2.url}
        assert {a.json()["choices"][0]["text"] for a in answers} == {"decoded by D"}
        other = {"model": "tiny", "prompt": "nothing shared", "max_tokens": 2}
        by_load = [client.post(f"{proxy.url}/v1/completions", json=other) for _ in range(4)]
        assert {a.headers["x-kvx-prefill"] for a in by_load} == {p1.url, p2.url}
        kv = client.get(f"{proxy.url}/kvx/servers").json()["kv_index"]
        assert kv["routed_by_prefix"]["prefill"] == 4
        # a stale entry (P2 lost the blocks, the event never came) only costs the route:
        # P2 down, the prefix request is served by P1, the same answer
        p2.behaviour.completion_status = 500
        stale = client.post(f"{proxy.url}/v1/completions", json=body)
        assert stale.status_code == 200 and stale.headers["x-kvx-prefill"] == p1.url
        assert stale.json()["choices"][0]["text"] == "decoded by D"
    finally:
        publisher.close()


def test_tokenize_failure_routes_by_load(stub, start_proxy, client, tmp_path):
    p1, p2, d = stub("P1"), stub("P2"), stub("D")
    proxy = start_proxy(
        [p1.url, p2.url],
        [d.url],
        routing="kv_aware",
        kv_events=(f"{p2.url}=ipc://{tmp_path}/none",),
    )
    # several prompts at once cannot be routed by one prefix: no /tokenize, by load
    body = {"model": "tiny", "prompt": ["a", "b"], "max_tokens": 2}
    answers = [client.post(f"{proxy.url}/v1/completions", json=body) for _ in range(2)]
    assert [a.status_code for a in answers] == [200, 200]
    assert {a.headers["x-kvx-prefill"] for a in answers} == {p1.url, p2.url}
    assert not [r for r in p1.behaviour.received + p2.behaviour.received if r.path == "/tokenize"]
