"""Mixture-of-experts hyper-parameters of Qwen3-MoE, Qwen2-MoE, Mixtral and gpt-oss, from an HF
config."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

MOE_TYPES = ("qwen3_moe", "qwen2_moe", "mixtral", "gpt_oss")


def _need(cfg: dict[str, Any], name: str) -> int:
    if cfg.get(name) is None:
        raise ValueError(f"{cfg['model_type']} config has no {name}")
    return int(cfg[name])


@dataclass(frozen=True)
class MoEConfig:
    """Router: softmax over ``num_experts``, the ``top_k`` largest (renormalized to sum 1 with
    ``normalize``); experts are SwiGLU MLPs of ``expert_intermediate_size``. ``sparse[i]``:
    whether layer i's MLP is the expert block (else a dense MLP of ``intermediate_size``)."""

    num_experts: int
    top_k: int
    expert_intermediate_size: int
    normalize: bool
    sparse: tuple[bool, ...]
    prefix: str  # the block's name in a layer: "mlp." or "block_sparse_moe."
    names: tuple[str, str, str]  # an expert's gate, up and down projections
    # Qwen2-MoE: an MLP every token takes, its output scaled by sigmoid(shared_expert_gate)
    shared_intermediate_size: int | None = None
    # gpt-oss: softmax over the top-k logits; biased router and experts; the clamped SwiGLU
    # (up + 1) * gate * sigmoid(alpha * gate); experts stored stacked, gate/up interleaved
    softmax_after_top_k: bool = False
    biases: bool = False
    swiglu_limit: float | None = None
    swiglu_alpha: float = 1.702
    stacked: bool = False
    router: str = "gate"

    @classmethod
    def from_hf_dict(cls, cfg: dict[str, Any]) -> MoEConfig:
        model_type = cfg["model_type"]
        layers = _need(cfg, "num_hidden_layers")
        experts = int(cfg.get("num_experts") or cfg.get("num_local_experts") or 0)
        top_k = _need(cfg, "num_experts_per_tok")
        if not 0 < top_k <= experts:
            raise ValueError(f"num_experts_per_tok {top_k} must be within 1..{experts} experts")
        if model_type == "gpt_oss":
            return cls(
                experts,
                top_k,
                _need(cfg, "intermediate_size"),
                False,
                (True,) * layers,
                "mlp.",
                ("gate_up_proj", "gate_up_proj", "down_proj"),
                softmax_after_top_k=True,
                biases=True,
                swiglu_limit=float(cfg.get("swiglu_limit", 7.0)),
                swiglu_alpha=float(cfg.get("swiglu_alpha", 1.702)),
                stacked=True,
                router="router",
            )
        if model_type == "mixtral":
            return cls(
                experts,
                top_k,
                _need(cfg, "intermediate_size"),
                True,
                (True,) * layers,
                "block_sparse_moe.",
                ("w1", "w3", "w2"),
            )
        step = int(cfg.get("decoder_sparse_step") or 1)
        dense = set(cfg.get("mlp_only_layers") or ())
        shared = (
            _need(cfg, "shared_expert_intermediate_size") if model_type == "qwen2_moe" else None
        )
        return cls(
            experts,
            top_k,
            _need(cfg, "moe_intermediate_size"),
            bool(cfg.get("norm_topk_prob", False)),
            tuple(i not in dense and (i + 1) % step == 0 for i in range(layers)),
            "mlp.",
            ("gate_proj", "up_proj", "down_proj"),
            shared,
        )
