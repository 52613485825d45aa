"""Architecture hyper-parameters of a Llama-family model, read from an HF ``config.json``."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from models.block_fp8 import check_config as block_fp8_config
from models.compressed import check_config
from models.gptq import check_config as gptq_config
from models.moe_config import MOE_TYPES, MoEConfig
from models.rope_scaling import RopeScaling, rope_params, rope_scaling

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "phi3", "gemma3_text", *MOE_TYPES)
WINDOWED_TYPES = ("mistral", "phi3", "mixtral")  # whose sliding_window applies to every layer
LAYERED = ("gemma3_text", "gpt_oss")  # whose layer_types say which layers slide


# fields that change the math, with the values implemented: others are refused at start-up
_MUST_BE: dict[str, tuple[object, ...]] = {
    "hidden_act": ("silu",),
    "mlp_bias": (False,),
    "partial_rotary_factor": (1, 1.0),
    "pretraining_tp": (1,),  # inference treats the whole projection as one: only 1 is exact
}


# fields of other families that scale or cap activations; any value here changes the math
_ABSENT = (
    "attn_logit_softcapping",
    "final_logit_softcapping",
    "logits_scaling",
    "embedding_multiplier",
    "residual_multiplier",
    "attention_multiplier",
    "query_pre_attn_scalar",
)


def _check_quantization(cfg: dict[str, Any]) -> None:
    q = cfg.get("quantization_config")
    if q is None:
        return
    method = q.get("quant_method", "unnamed") if isinstance(q, dict) else type(q).__name__
    if method == "compressed-tensors":
        check_config(q)
        return
    if method == "fp8":
        block_fp8_config(q)
        return
    if method in ("gptq", "awq"):
        gptq_config(q)
        return
    raise ValueError(
        f"unsupported quantization_config.quant_method {method!r}: tandem loads pre-quantized "
        "checkpoints in the compressed-tensors, block-wise fp8, GPTQ and AWQ formats (others "
        "would be read without their scales); serve one of those or an unquantized checkpoint "
        "(optionally with quantization: int8 or fp8)"
    )


def _check_fields(cfg: dict[str, Any]) -> None:
    _check_quantization(cfg)
    gemma = cfg.get("model_type") == "gemma3_text"
    for field in _ABSENT:
        if field == "query_pre_attn_scalar" and gemma:
            continue
        if cfg.get(field) is not None:
            raise ValueError(f"unsupported {field} {cfg[field]!r}: not implemented")
    model_type = cfg.get("model_type", "llama")
    if model_type not in MODEL_TYPES:
        why = {
            "phi3small": "Phi-3-small's blocksparse attention is not implemented",
            "phimoe": "PhiMoE's sparsemixer routing is not implemented",
        }.get(str(model_type), f"tandem implements {list(MODEL_TYPES)}")
        raise ValueError(f"unsupported model_type {model_type!r}: {why}")
    if gemma:
        act = cfg.get("hidden_activation") or cfg.get("hidden_act")
        if act != "gelu_pytorch_tanh":
            raise ValueError(f"unsupported hidden_activation {act!r}: gelu_pytorch_tanh only")
        if cfg.get("use_bidirectional_attention"):
            raise ValueError("unsupported use_bidirectional_attention True: causal only")
    for field, allowed in _MUST_BE.items():
        if gemma and field == "hidden_act":
            continue
        if field in cfg and cfg[field] is not None and cfg[field] not in allowed:
            raise ValueError(
                f"unsupported {field} {cfg[field]!r}: tandem implements {allowed[0]!r} only"
            )
    window = _window(cfg)
    if window is not None and model_type not in (*WINDOWED_TYPES, *LAYERED):
        raise ValueError(
            f"unsupported sliding_window {window} for model_type {model_type!r}: its window "
            f"applies to some layers only (max_window_layers), which is not implemented"
        )
    kinds = set(cfg.get("layer_types") or ()) - {"full_attention", "sliding_attention"}
    if kinds:
        raise ValueError(f"unsupported layer_types {sorted(kinds)}: only full and sliding")


def _window(cfg: dict[str, Any]) -> int | None:
    window = cfg.get("sliding_window")
    context = int(cfg.get("max_position_embeddings", 4096))
    if window is None or not cfg.get("use_sliding_window", True) or int(window) >= context:
        return None
    return int(window)


def text_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """A multimodal Gemma 3 folder's language model (served text-only), else ``cfg``."""
    if cfg.get("model_type") != "gemma3":
        return cfg
    text = {"model_type": "gemma3_text", **cfg.get("text_config", {})}
    for key in ("bos_token_id", "eos_token_id", "tie_word_embeddings", "quantization_config"):
        if key in cfg and key not in text:
            text[key] = cfg[key]
    return text


@dataclass(frozen=True)
class LayerWindows:
    """Per-layer attention (Gemma 3, gpt-oss): ``sliding[i]`` layers see the last ``window``
    positions, rotating by ``local_rope_theta`` (None: the model's own rope)."""

    sliding: tuple[bool, ...]
    window: int
    local_rope_theta: float | None

    @classmethod
    def from_hf_dict(cls, cfg: dict[str, Any]) -> LayerWindows | None:
        layers = int(cfg["num_hidden_layers"])
        kinds = cfg.get("layer_types")
        gemma = cfg.get("model_type") == "gemma3_text"
        if not kinds and gemma:  # older Gemma configs: every n-th layer is global
            n = int(cfg.get("sliding_window_pattern") or cfg.get("_sliding_window_pattern") or 6)
            kinds = [
                "full_attention" if (i + 1) % n == 0 else "sliding_attention" for i in range(layers)
            ]
        if not kinds or "sliding_attention" not in kinds or not cfg.get("sliding_window"):
            return None
        theta = None
        if gemma:
            rope = cfg.get("rope_parameters") or {}
            local = rope.get("sliding_attention") if isinstance(rope, dict) else None
            if isinstance(local, dict) and local.get("rope_type", "default") != "default":
                raise ValueError(f"unsupported sliding layers' rope_type {local['rope_type']!r}")
            theta = float((local or {}).get("rope_theta", cfg.get("rope_local_base_freq", 10000.0)))
        return cls(
            tuple(k == "sliding_attention" for k in kinds), int(cfg["sliding_window"]), theta
        )


@dataclass(frozen=True)
class GemmaShape:
    """Gemma 3's differences from a Llama layer: RMSNorms scale by ``1 + weight`` (stored so
    at load), embeddings times sqrt(hidden), a norm after attention and around the MLP,
    gelu-tanh, and ``query_pre_attn_scalar``."""

    query_pre_attn_scalar: float

    @classmethod
    def from_hf_dict(cls, cfg: dict[str, Any]) -> GemmaShape:
        return cls(float(cfg.get("query_pre_attn_scalar") or cfg["head_dim"]))


@dataclass(frozen=True)
class LlamaConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    rope_scaling: RopeScaling = dataclasses.field(default_factory=RopeScaling)
    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: bool = False  # per-head RMSNorm of queries and keys before RoPE (Qwen3)
    sliding_window: int | None = None
    fused_projections: bool = False  # Phi-3: qkv_proj and gate_up_proj stored as one tensor each
    moe: MoEConfig | None = None  # Qwen3-MoE, Mixtral: the expert blocks
    gemma: GemmaShape | None = None  # Gemma 3: its norms, activation and attention scale
    layer_windows: LayerWindows | None = None  # sliding and full layers (Gemma 3, gpt-oss)
    attention_sinks: bool = False  # gpt-oss: a learned logit per head joins each softmax

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @classmethod
    def from_hf_dict(cls, cfg: dict[str, Any]) -> LlamaConfig:
        """Raises ValueError for a field value that changes the math in an unimplemented way."""
        cfg = text_config(cfg)
        _check_fields(cfg)
        rope = rope_params(cfg)
        theta = rope.get("rope_theta", cfg.get("rope_theta", 10000.0))
        heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        return cls(
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads", heads)),
            head_dim=int(cfg.get("head_dim") or hidden // heads),
            rope_theta=float(theta),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=tuple(int(e) for e in eos_ids),
            rope_scaling=rope_scaling(cfg),
            qkv_bias=cfg.get("model_type") == "qwen2"
            or (cfg.get("model_type") == "qwen2_moe" and bool(cfg.get("qkv_bias", True)))
            or bool(cfg.get("attention_bias")),
            o_bias=bool(cfg.get("attention_bias")),
            qk_norm=cfg.get("model_type") in ("qwen3", "qwen3_moe", "gemma3_text"),
            sliding_window=None if cfg.get("model_type") in LAYERED else _window(cfg),
            fused_projections=cfg.get("model_type") == "phi3",
            moe=MoEConfig.from_hf_dict(cfg) if cfg.get("model_type") in MOE_TYPES else None,
            gemma=GemmaShape.from_hf_dict(cfg) if cfg.get("model_type") == "gemma3_text" else None,
            layer_windows=LayerWindows.from_hf_dict(cfg)
            if cfg.get("model_type") in LAYERED
            else None,
            attention_sinks=cfg.get("model_type") == "gpt_oss",
        )

    @classmethod
    def from_folder(cls, folder: Path) -> LlamaConfig:
        return cls.from_hf_dict(json.loads((folder / "config.json").read_text()))
