"""Tiny random checkpoints of every supported family (``FAMILIES``), written by transformers
with sharp distributions (weights and biases drawn at 0.08): what ``bench.families`` serves and
the family tests load."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import torch

SHAPE: dict[str, Any] = {
    "vocab_size": 256,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 1024,
    "rope_theta": 10000.0,
    "tie_word_embeddings": True,
}
FAMILIES: dict[str, tuple[str, dict[str, Any]]] = {
    # original context 64: positions past it cross every band of llama3's blend
    "llama3-rope": (
        "llama",
        {
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            }
        },
    ),
    "linear-rope": ("llama", {"rope_scaling": {"rope_type": "linear", "factor": 4.0}}),
    "llama-attention-bias": ("llama", {"attention_bias": True}),  # q, k, v and o biases
    "qwen2": ("qwen2", {"use_sliding_window": False, "tie_word_embeddings": False}),
    "mistral": ("mistral", {"sliding_window": None}),
    # a window of 64 positions: longer prompts and the steps after them reach past it
    "mistral-window": ("mistral", {"sliding_window": 64}),
    "qwen3": ("qwen3", {"use_sliding_window": False, "tie_word_embeddings": False}),
    # YaRN over an original context of 64: the ramp crosses the frequencies; cos/sin scaled
    "qwen3-yarn": (
        "qwen3",
        {
            "use_sliding_window": False,
            "rope_scaling": {
                "rope_type": "yarn",
                "factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        },
    ),
    # fused qkv and gate/up projections; Phi-3-mini's window, scaled to the tiny context
    "phi3": ("phi3", {"tie_word_embeddings": False, "sliding_window": 64, "pad_token_id": 0}),
    # 8 experts, top 2 renormalized; layer 0 dense (mlp_only_layers), layer 1 sparse
    "qwen3-moe": (
        "qwen3_moe",
        {
            "num_experts": 8,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "norm_topk_prob": True,
            "mlp_only_layers": [0],
            "use_sliding_window": False,
            "tie_word_embeddings": False,
        },
    ),
    # a sliding layer (32 positions, its own rope base) then a global one (linear rope x8);
    # query_pre_attn_scalar other than head_dim; (1 + w) norms around attention and the MLP
    "gemma3": (
        "gemma3_text",
        {
            "layer_types": ["sliding_attention", "full_attention"],
            "sliding_window": 32,
            "query_pre_attn_scalar": 24,
            "rope_scaling": {"rope_type": "linear", "factor": 8.0},
        },
    ),
    # Qwen2-MoE: q/k/v biases, experts not renormalized, a gated shared expert every token takes
    "qwen2-moe": (
        "qwen2_moe",
        {
            "num_experts": 8,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "shared_expert_intermediate_size": 96,
            "norm_topk_prob": False,
            "use_sliding_window": False,
            "tie_word_embeddings": False,
        },
    ),
    # gpt-oss: attention sinks, a sliding layer then a full one, YaRN, biased experts with the
    # clamped SwiGLU, softmax over the top-k logits
    "gpt-oss": (
        "gpt_oss",
        {
            "intermediate_size": 32,
            "num_local_experts": 8,
            "num_experts_per_tok": 2,
            "sliding_window": 32,
            "layer_types": ["sliding_attention", "full_attention"],
            "rope_scaling": {
                "rope_type": "yarn",
                "factor": 4.0,
                "original_max_position_embeddings": 64,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
                "truncate": False,
            },
        },
    ),
    "mixtral": (
        "mixtral",
        {"num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": None},
    ),
}


def family_checkpoint(
    folder: Path, family: str, vocab_size: int = 256, tokenizer_from: Path | None = None
) -> Path:
    """A tiny random checkpoint of ``family`` (sharp distributions: weights and biases drawn
    at 0.08), with ``tokenizer_from``'s tokenizer files when given (then ``vocab_size`` must be
    that tokenizer's)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    model_type, extra = FAMILIES[family]
    cfg = AutoConfig.for_model(model_type, **{**SHAPE, "vocab_size": vocab_size, **extra})
    torch.manual_seed(5)
    model = AutoModelForCausalLM.from_config(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.08)
    model.save_pretrained(folder)
    if tokenizer_from is not None:
        for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
            if (tokenizer_from / name).exists():
                shutil.copy(tokenizer_from / name, folder / name)
    return folder
