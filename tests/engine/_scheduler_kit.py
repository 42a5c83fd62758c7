"""The scripted connector and helpers shared by the reference scheduler's tests.

`ScriptedConnector` is a real connector written against the public contract: what it loads is
scripted per request through `kv_transfer_params` (`load`, `async`, `bad`, `silent`, `fail`,
`hold`), and its worker side writes the KV the model would have computed into the paged cache
(corrupting the `bad` blocks). Engines load it through `kv_connector_module_path`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from kvx import (
    EngineContext,
    ForwardContext,
    KVCacheBlocks,
    KVCacheSpec,
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorOutput,
    KVConnectorRole,
    KVTransferConfig,
    KVTransferResults,
    Request,
    RequestStatus,
    SchedulerOutput,
)
from kvx.engine import (
    Engine,
    EngineConfig,
    RequestOutput,
    Scheduler,
    SchedulerConfig,
    ToyModel,
    prefix_hashes,
)
from kvx.engine.kv_cache import rank_heads

BS = 16
SMALL: dict[str, Any] = {"num_layers": 2, "num_kv_heads": 2, "head_size": 8, "block_size": BS}
TOKEN = 7  # what Scheduler-level tests "sample"


# -- the scripted connector ------------------------------------------------------------------


@dataclass
class Load:
    req_id: str
    token_ids: list[int]
    block_ids: list[int]
    start: int
    end: int
    is_async: bool
    bad: list[int] = field(default_factory=list)  # block indices (in the request's table)
    silent: bool = False  # corrupt the bad blocks without reporting them
    fail: bool = False  # the whole receive fails (failed_recving), nothing is written


@dataclass
class ScriptedMeta(KVConnectorMetadata):
    loads: list[Load] = field(default_factory=list)
    sends: list[str] = field(default_factory=list)


class ScriptedConnector(KVConnectorBase_V1):
    """Loads what `kv_transfer_params["load"]` says (a token count or "all"); holds finished
    requests whose params say `hold` until its workers report them sent (next step)."""

    def __init__(self, config: KVTransferConfig, role: KVConnectorRole, ctx: EngineContext):
        super().__init__(config, role, ctx)
        self.calls: list[tuple[Any, ...]] = []
        self.sched_outputs: list[SchedulerOutput] = []
        self._loads: list[Load] = []
        self._sends: list[str] = []
        self._caches: dict[str, torch.Tensor] = {}
        self._recv_done: set[str] = set()
        self._recv_failed: set[str] = set()
        self._sent: set[str] = set()
        self._errors: set[int] = set()

    # scheduler side
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> Any:
        self.calls.append(("match", request.request_id, num_computed_tokens))
        params = request.kv_transfer_params or {}
        if "load" not in params or params.get("loaded"):
            return 0, False
        total = request.num_prompt_tokens
        if params["load"] != "all":
            total = min(total, params["load"])
        count = max(0, total - num_computed_tokens)
        return count, bool(params.get("async")) and count > 0

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        self.calls.append(("alloc", request.request_id, num_external_tokens))
        params = request.kv_transfer_params or {}
        if num_external_tokens == 0 or "load" not in params or params.get("loaded"):
            return
        params["loaded"] = True
        start = (blocks.num_hashed_blocks or (0,))[0] * self.engine_context.cache.block_size
        self._loads.append(
            Load(
                request.request_id,
                list(request.prompt_token_ids),
                list(blocks.get_block_ids()[0]),
                start,
                start + num_external_tokens,
                bool(params.get("async")),
                list(params.get("bad", [])),
                bool(params.get("silent")),
                bool(params.get("fail")),
            )
        )

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> ScriptedMeta:
        self.calls.append(("build_meta",))
        self.sched_outputs.append(scheduler_output)
        meta = ScriptedMeta(self._loads, self._sends)
        self._loads, self._sends = [], []
        return meta

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        self.calls.append(("update_output",))

    def request_finished(self, request: Request, block_ids: list[int]) -> Any:
        self.calls.append(("finished", request.request_id, request.status, list(block_ids)))
        params = request.kv_transfer_params or {}
        if params.get("hold") and request.status in (
            RequestStatus.FINISHED_LENGTH_CAPPED,
            RequestStatus.FINISHED_STOPPED,
        ):
            self._sends.append(request.request_id)
            return True, {"remote_block_ids": list(block_ids), "remote_request_id": "p-1"}
        return False, None

    # worker side
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._caches = dict(kv_caches)

    def handle_preemptions(self, preempted_req_ids: set[str]) -> None:
        self.calls.append(("handle_preemptions", frozenset(preempted_req_ids)))

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        self.calls.append(("bind",))
        super().bind_connector_metadata(connector_metadata)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, ScriptedMeta)
        self._sent.update(meta.sends)
        for load in meta.loads:
            if load.fail:
                self._recv_failed.add(load.req_id)
                continue
            self._write(load)
            if not load.silent:
                self._errors.update(load.block_ids[i] for i in load.bad if i < len(load.block_ids))
            if load.is_async:
                self._recv_done.add(load.req_id)

    def _write(self, load: Load) -> None:
        spec, par = self.engine_context.cache, self.engine_context.parallel
        assert spec.layout == "NHD"
        model = ToyModel(spec.num_layers, spec.num_kv_heads, spec.head_size)
        heads = rank_heads(spec.num_kv_heads, par.tp_size, par.tp_rank)
        hashes = prefix_hashes(load.token_ids)
        pos = torch.arange(load.start, load.end)
        table = torch.tensor(load.block_ids, dtype=torch.long)
        blocks, offsets = table[pos // spec.block_size], pos % spec.block_size
        for name, tensor in self._caches.items():
            layer = spec.layer_names.index(name)
            kv = model.token_kv(hashes[load.start : load.end], layer, heads, tensor.dtype)
            for i in load.bad:
                kv[(pos // spec.block_size) == i] += 1.0
            tensor.permute(1, 2, 0, 3, 4)[blocks, offsets] = kv

    def wait_for_layer_load(self, layer_name: str) -> None:
        pass

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kw: Any) -> None:
        pass

    def wait_for_save(self) -> None:
        pass

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVTransferResults:
        sent, self._sent = self._sent, set()
        done, self._recv_done = self._recv_done, set()
        failed, self._recv_failed = self._recv_failed, set()
        return KVTransferResults(sent, done | failed, failed)

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._errors = self._errors, set()
        return errors


# -- helpers ---------------------------------------------------------------------------------

CTX = EngineContext("sched", "m", KVCacheSpec(("l0", "l1"), 2, 8, BS))


def scheduler(num_blocks: int = 16, **config: Any) -> tuple[Scheduler, ScriptedConnector]:
    connector = ScriptedConnector(
        KVTransferConfig(kv_connector="ScriptedConnector", kv_role="kv_both"),
        KVConnectorRole.SCHEDULER,
        CTX,
    )
    return Scheduler(SchedulerConfig(num_blocks, BS, **config), connector), connector


def step(
    s: Scheduler, kv: KVConnectorOutput | None = None
) -> tuple[SchedulerOutput, list[RequestOutput]]:
    out = s.schedule()
    return out, s.update_from_output(out, {r: TOKEN for r in out.num_scheduled_tokens}, kv)


def status(s: Scheduler, req_id: str) -> RequestStatus:
    return s.states[req_id].request.status


def is_empty(s: Scheduler) -> bool:
    return (
        not s.has_pending_work()
        and s.pool.num_free_blocks == s.config.num_blocks
        and all(c == 0 for c in s.pool.ref_cnt)
        and s.held_blocks() == {}
    )


def scripted_kv(policy: str = "fail", role: str = "kv_both") -> KVTransferConfig:
    return KVTransferConfig.from_dict(
        {
            "kv_connector": "ScriptedConnector",
            "kv_connector_module_path": __name__,
            "kv_role": role,
            "kv_load_failure_policy": policy,
        }
    )


def make_engine(policy: str | None = "fail", **config: Any) -> Engine:
    kv = None if policy is None else scripted_kv(policy)
    return Engine(EngineConfig(**{**SMALL, "num_blocks": 32, **config}, kv_transfer_config=kv))


def sched_conn(engine: Engine) -> ScriptedConnector:
    assert isinstance(engine.scheduler_connector, ScriptedConnector)
    return engine.scheduler_connector


def run(engine: Engine, max_steps: int = 300) -> dict[str, RequestOutput]:
    """Step to the end, checking the KV bytes after every step; the final output per request."""
    final: dict[str, RequestOutput] = {}
    for _ in range(max_steps):
        if not engine.has_pending_work():
            return final
        for out in engine.step():
            assert out.request_id not in final, f"{out.request_id} finished twice"
            if out.finished:
                final[out.request_id] = out
        assert engine.check_kv() == []
    raise AssertionError(f"engine did not finish in {max_steps} steps")


def baseline(prompts: dict[str, list[int]], max_tokens: int) -> dict[str, list[int]]:
    engine = make_engine(None, num_blocks=64)
    try:
        for rid, prompt in prompts.items():
            engine.add_request(rid, prompt, max_tokens)
        return {rid: out.output_token_ids for rid, out in run(engine).items()}
    finally:
        engine.shutdown()


def prompt(n: int, offset: int = 0) -> list[int]:
    return [(offset + 37 * i + 11) % 1000 for i in range(n)]


def remote(**extra: Any) -> dict[str, Any]:
    return {"load": "all", "async": True, **extra}


def scheduled_history(engine: Engine, req_id: str) -> list[tuple[int, int]]:
    """(num_computed_tokens before the step, tokens scheduled) of every step that ran req_id."""
    history = []
    for out in sched_conn(engine).sched_outputs:
        if req_id not in out.num_scheduled_tokens:
            continue
        starts = {n.req_id: n.num_computed_tokens for n in out.scheduled_new_reqs}
        cached = out.scheduled_cached_reqs
        starts.update(zip(cached.req_ids, cached.num_computed_tokens, strict=True))
        history.append((starts[req_id], out.num_scheduled_tokens[req_id]))
    return history
