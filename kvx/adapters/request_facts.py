"""Per-request transfer facts: for each request an engine finishes, which connector moved how
many tokens, blocks and bytes for it, how long the load took and how it ended.

Kept on the scheduler side of the vLLM adapter, from what that side sees: the tokens a connector
promised (`update_state_after_alloc`), the sources it named, the workers' reports of finished or
failed loads and of blocks that failed to load, and the failure kinds in the same step's stats.
`finished` gives the facts, which the adapter returns in the request's `kv_transfer_params`
(under `FACTS_KEY`, keyed by this engine's leg: `prefill` on a P asked to keep its KV for a
remote decoder, else `decode`), and logs them as one JSON line on the `kvx.requests` logger.
With tracing on and a trace context in the request's params (`kvx.tracing`), the same facts
become spans: `kvx.prefill` or `kvx.decode` (arrival to finish), `kvx.load` (the load) and,
for blocks P holds for D, `kvx.handoff` (until the worker reports them sent or released).

No vLLM import: the adapter hands it kvx types.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from kvx import tracing
from kvx.contract.stats import KVConnectorStats
from kvx.contract.types import NULL_BLOCK, KVCacheBlocks, KVCacheSpec, Request

REQUEST_LOG = logging.getLogger("kvx.requests")
"""One INFO line per finished request: its facts as one JSON object."""

FACTS_KEY = "kvx_transfer"
"""The `kv_transfer_params` key holding the facts, one entry per leg (`prefill`, `decode`)."""

MAX_HANDOFFS = 4096
"""Hand-off spans waiting for their end at most; the oldest is dropped beyond."""

MAX_PEER_FACTS_BYTES = 4096
"""The largest facts of another leg (P's, arriving in D's request) passed on; larger or
malformed ones are dropped (the request's params come from a client or a peer)."""


def log_to_stderr() -> None:
    """Give `kvx.requests` a stderr handler at INFO unless logging was set up for it (vLLM
    configures only its own loggers, so the lines would otherwise go nowhere)."""
    if REQUEST_LOG.handlers or REQUEST_LOG.level != logging.NOTSET:
        return
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s %(message)s"))
    REQUEST_LOG.addHandler(handler)
    REQUEST_LOG.setLevel(logging.INFO)
    REQUEST_LOG.propagate = False


_DTYPE_BYTES = {"float64": 8, "float32": 4, "float16": 2, "bfloat16": 2, "int8": 1, "uint8": 1}


def block_bytes(cache: KVCacheSpec) -> int:
    """KV bytes of one block of this engine's cache: every layer, K and V (the latent alone for
    MLA), every KV head of the model."""
    itemsize = _DTYPE_BYTES.get(cache.dtype)
    if itemsize is None:
        itemsize = cache.torch_dtype.itemsize
    planes = 1 if cache.use_mla else 2
    heads = 1 if cache.use_mla else cache.num_kv_heads
    return cache.num_layers * planes * heads * cache.head_size * cache.block_size * itemsize


@dataclass
class _Load:
    tokens: int
    blocks: int
    block_ids: set[int]
    started: float
    is_async: bool
    sources: dict[str, int] = field(default_factory=dict)
    scheduled: bool = False
    seconds: float | None = None
    outcome: str | None = None
    failure: str | None = None


@dataclass
class _Entry:
    arrived: float
    is_async: bool = False
    load: _Load | None = None


class RequestFacts:
    """The facts of every live request of one engine's scheduler side."""

    def __init__(
        self,
        connector: str,
        engine_id: str,
        cache: KVCacheSpec,
        failure_policy: str,
        clock: Callable[[], float] = time.monotonic,  # spans read it as time.monotonic
    ) -> None:
        self.connector, self.engine_id, self.cache = connector, engine_id, cache
        self.failure_policy = failure_policy
        self.block_bytes = block_bytes(cache)
        self._clock = clock
        self._live: dict[str, _Entry] = {}
        self._handoffs: dict[str, tuple[float, Any, dict[str, Any]]] = {}
        self._in_step: set[str] = set()  # in-step loads scheduled, not yet reported

    def _entry(self, req_id: str) -> _Entry:
        entry = self._live.get(req_id)
        if entry is None:
            entry = self._live[req_id] = _Entry(self._clock())
        return entry

    def arrived(self, req_id: str) -> None:
        self._entry(req_id)

    def matched(self, req_id: str, is_async: bool) -> None:
        self._entry(req_id).is_async = is_async

    def allocated(self, request: Request, blocks: KVCacheBlocks, external_tokens: int) -> None:
        """A load of `external_tokens` after the request's computed ones was promised."""
        entry = self._entry(request.request_id)
        if external_tokens <= 0 or entry.load is not None:
            return
        size = self.cache.block_size
        start = request.num_computed_tokens
        count = -(-(start + external_tokens) // size) - start // size
        ids = {b for group in blocks.block_ids for b in group if b != NULL_BLOCK}
        entry.load = _Load(external_tokens, count, ids, self._clock(), entry.is_async)

    def sources(self, req_id: str, sources: dict[str, int]) -> None:
        entry = self._live.get(req_id)
        if entry is not None and entry.load is not None:
            entry.load.sources = {k: v for k, v in sources.items() if v}

    def scheduled(self, req_ids: Iterable[str]) -> None:
        """The step being built runs these requests: a load not done asynchronously happens in
        it, so an earlier scheduled one is done."""
        now = self._clock()
        for req_id in req_ids:
            load = self._load(req_id)
            if load is None or load.is_async or load.outcome is not None:
                continue
            if load.scheduled:
                self._settle(load, "loaded", now)
            else:
                load.scheduled = True
                self._in_step.add(req_id)

    def output(
        self,
        finished_recving: Iterable[str],
        failed_recving: Iterable[str],
        invalid_block_ids: set[int],
        stats: KVConnectorStats | None,
        finished_sending: Iterable[str] = (),
    ) -> None:
        """One step's worker reports (aggregated over workers)."""
        now = self._clock()
        for req_id in finished_sending:
            handoff = self._handoffs.pop(req_id, None)
            if handoff is not None:
                started, parent, attributes = handoff
                tracing.engine_span("kvx.handoff", parent, started, now, attributes)
        failed = set(failed_recving)
        if invalid_block_ids:
            failed |= {
                req_id
                for req_id, entry in self._live.items()
                if entry.load is not None and entry.load.block_ids & invalid_block_ids
            }
        kind = _failure_kind(stats) if failed else None
        for req_id in failed:
            load = self._load(req_id)
            if load is not None and load.outcome is None:
                outcome = "recomputed" if self.failure_policy == "recompute" else "failed"
                self._settle(load, outcome, now, kind)
        for req_id in finished_recving:
            load = self._load(req_id)
            if load is not None and load.outcome is None and req_id not in failed:
                self._settle(load, "loaded", now)
        for req_id in self._in_step:
            load = self._load(req_id)
            if load is not None and load.outcome is None:
                self._settle(load, "loaded", now)
        self._in_step.clear()

    def _load(self, req_id: str) -> _Load | None:
        entry = self._live.get(req_id)
        return entry.load if entry is not None else None

    def _settle(self, load: _Load, outcome: str, now: float, failure: str | None = None) -> None:
        load.outcome, load.failure = outcome, failure
        load.seconds = now - load.started

    def finished(
        self, request: Request, block_ids: list[int], held: bool, params: dict[str, Any] | None
    ) -> dict[str, Any]:
        """`params` (the connector's answer for this request) with this leg's facts added, and
        the facts logged; the request is forgotten."""
        entry = self._live.pop(request.request_id, None) or _Entry(self._clock())
        self._in_step.discard(request.request_id)
        now = self._clock()
        incoming = request.kv_transfer_params or {}
        leg = "prefill" if incoming.get("do_remote_decode") else "decode"
        facts: dict[str, Any] = {
            "connector": self.connector,
            "engine_id": self.engine_id,
            "request_id": request.request_id,
            "prompt_tokens": len(request.prompt_token_ids),
            "seconds": round(now - entry.arrived, 6),
        }
        load = entry.load
        if load is not None:
            if load.outcome is None:  # finished before any report (aborted while loading)
                self._settle(load, "failed" if load.is_async else "loaded", now)
            facts["load"] = self._load_facts(load, incoming)
        if leg == "prefill":
            kept = sum(1 for b in block_ids if b != NULL_BLOCK)
            facts["kept"] = {"blocks": kept, "bytes": kept * self.block_bytes, "held": held}
        legs = _peer_facts(incoming)
        legs[leg] = facts
        parent = tracing.parent_of(incoming)
        if parent is not None:
            self._trace(leg, facts, entry, parent, now, held)
        REQUEST_LOG.info("%s", json.dumps({"leg": leg, **facts}, separators=(",", ":")))
        return {**(params or {}), FACTS_KEY: legs}

    def _trace(
        self, leg: str, facts: dict[str, Any], entry: _Entry, parent: Any, now: float, held: bool
    ) -> None:
        """The facts as spans under the proxy's leg span."""
        attributes = {f"kvx.{k}": v for k, v in facts.items()}
        for key, value in (facts.get("load") or {}).items():
            attributes[f"kvx.load.{key}"] = value
        for key, value in (facts.get("kept") or {}).items():
            attributes[f"kvx.kept.{key}"] = value
        tracing.engine_span(f"kvx.{leg}", parent, entry.arrived, now, attributes)
        load = entry.load
        if load is not None:
            end = load.started + (load.seconds or 0.0)
            tracing.engine_span("kvx.load", parent, load.started, end, attributes)
        if held:
            self._handoffs[facts["request_id"]] = (now, parent, attributes)
            while len(self._handoffs) > MAX_HANDOFFS:
                self._handoffs.pop(next(iter(self._handoffs)))

    def _load_facts(self, load: _Load, incoming: dict[str, Any]) -> dict[str, Any]:
        out: dict[str, Any] = {
            "tokens": load.tokens,
            "blocks": load.blocks,
            "bytes": load.blocks * self.block_bytes,
            "seconds": round(load.seconds or 0.0, 6),
            "outcome": load.outcome,
        }
        if load.failure is not None:
            out["failure"] = load.failure
        if load.sources:
            out["sources"] = load.sources
        host, port = incoming.get("remote_host"), incoming.get("remote_port")
        if isinstance(host, str) and isinstance(port, int) and len(host) <= 255:
            out["peer"] = f"{host}:{port}"
        return out

    def __len__(self) -> int:
        return len(self._live)


def _failure_kind(stats: KVConnectorStats | None) -> str:
    """The failure kinds the step's stats counted (`a+b` when several), `unknown` if none."""
    if stats is None:
        return "unknown"
    try:
        by_connector = stats.figures_by_connector("")
    except Exception:  # a third-party stats type that cannot give figures
        return "unknown"
    kinds = sorted({k for f in by_connector.values() for k, n in f.failures.items() if n})
    return "+".join(kinds) or "unknown"


def _peer_facts(incoming: dict[str, Any]) -> dict[str, Any]:
    """The other leg's facts arriving in this request's params (P's, on D), if well formed and
    small; only the `prefill` entry is taken."""
    legs = incoming.get(FACTS_KEY)
    if not isinstance(legs, dict) or not isinstance(legs.get("prefill"), dict):
        return {}
    try:
        size = len(json.dumps(legs["prefill"]))
    except (TypeError, ValueError):
        return {}
    return {"prefill": legs["prefill"]} if size <= MAX_PEER_FACTS_BYTES else {}
