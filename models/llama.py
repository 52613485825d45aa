"""The Llama-family decoder over a paged KV cache, tensor-parallel by heads and MLP columns."""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch
from torch import nn

from models.attention.backend import paged_attention
from models.attention.metadata import StepMetadata
from models.attention.sinks import sink_attention
from models.config import LlamaConfig
from models.layers import RMSNorm, RotaryEmbedding, RowOps
from models.moe import SparseMoE
from models.parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    ServedLinear,
    TPContext,
    VocabParallelEmbedding,
    tp_group,
)
from models.prequantized import PrequantizedCheckpoint
from models.quant import Quant
from models.weights import Sliceable, split_rows, whole


class LlamaAttention(nn.Module):
    def __init__(
        self,
        cfg: LlamaConfig,
        tp: TPContext,
        dtype: torch.dtype,
        device: torch.device,
        in_features: int | None = None,
        ops: RowOps | None = None,
    ) -> None:
        super().__init__()
        self.num_heads = tp.shard(cfg.num_heads, "num_attention_heads")
        self.num_kv_heads = tp.shard(cfg.num_kv_heads, "num_key_value_heads")
        self.head_dim = cfg.head_dim
        self.scale = (cfg.gemma.query_pre_attn_scalar if cfg.gemma else cfg.head_dim) ** -0.5
        h = cfg.hidden_size
        self.qkv_proj = ColumnParallelLinear(
            in_features or h,
            [cfg.q_size, cfg.kv_size, cfg.kv_size],
            tp,
            dtype,
            device,
            bias=cfg.qkv_bias,
        )
        self.o_proj = RowParallelLinear(cfg.q_size, h, tp, dtype, device, bias=cfg.o_bias)
        # Qwen3: one RMSNorm over head_dim for every query head, one for every key head
        self.q_norm: RMSNorm | None = None
        self.k_norm: RMSNorm | None = None
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, dtype, device, ops)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, dtype, device, ops)
        self.tp = tp
        self.sinks: nn.Parameter | None = None  # [Hq_local] gpt-oss's
        if cfg.attention_sinks:
            self.sinks = nn.Parameter(
                torch.empty(self.num_heads, dtype=dtype, device=device), requires_grad=False
            )

    def forward(
        self,
        x: torch.Tensor,
        rope: RotaryEmbedding,
        layer_kv: torch.Tensor,
        meta: StepMetadata,
    ) -> torch.Tensor:
        # x: [T, hidden]; layer_kv: [num_blocks, 2, Hkv_local, block_size, D]
        t = x.shape[0]
        qkv = self.qkv_proj(x)
        q_end = self.num_heads * self.head_dim
        k_end = q_end + self.num_kv_heads * self.head_dim
        v = qkv[:, k_end:].view(t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q = self.q_norm(qkv[:, :q_end].view(t, self.num_heads, self.head_dim))
            k = self.k_norm(qkv[:, q_end:k_end].view(t, self.num_kv_heads, self.head_dim))
            q, k = rope(meta.cos, meta.sin, q), rope(meta.cos, meta.sin, k)
        else:
            qk = rope(meta.cos, meta.sin, qkv[:, :k_end].view(t, -1, self.head_dim))
            q, k = qk[:, : self.num_heads], qk[:, self.num_heads :]
        if self.sinks is not None:
            out = sink_attention(q, k, v, layer_kv, meta, self.scale, self.sinks)
        else:
            out = paged_attention(q, k, v, layer_kv, meta, self.scale)  # [T, Hq_local * D]
        y: torch.Tensor = self.o_proj(out)
        return y


class LlamaMLP(nn.Module):
    def __init__(
        self,
        cfg: LlamaConfig,
        tp: TPContext,
        dtype: torch.dtype,
        device: torch.device,
        ops: RowOps | None = None,
    ) -> None:
        super().__init__()
        self.ops = ops or RowOps()
        inter = cfg.intermediate_size
        self.local_inter = tp.shard(inter, "intermediate_size")
        self.gate_up_proj = ColumnParallelLinear(cfg.hidden_size, [inter, inter], tp, dtype, device)
        self.down_proj = RowParallelLinear(inter, cfg.hidden_size, tp, dtype, device)
        self.gelu = cfg.gemma is not None  # gelu_pytorch_tanh

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if self.gelu:
            gate, up = gate_up.split(self.local_inter, dim=-1)
            act = nn.functional.gelu(gate, approximate="tanh") * up
        else:
            act = self.ops.silu_mul(gate_up, self.local_inter)
        y: torch.Tensor = self.down_proj(act)
        return y


class LlamaDecoderLayer(nn.Module):
    def __init__(
        self,
        cfg: LlamaConfig,
        tp: TPContext,
        dtype: torch.dtype,
        device: torch.device,
        input_norm: bool = True,  # EAGLE heads skip it: their input is already normalized
        ops: RowOps | None = None,
        sparse: bool = False,  # the MLP is cfg.moe's expert block
        sliding: bool = False,  # attends through the step's local metadata (Gemma 3)
    ) -> None:
        super().__init__()
        self.input_layernorm: nn.Module = (
            RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device, ops)
            if input_norm
            else nn.Identity()
        )
        self.self_attn = LlamaAttention(cfg, tp, dtype, device, ops=ops)
        eps = cfg.rms_norm_eps
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, eps, dtype, device, ops)
        self.mlp: LlamaMLP | SparseMoE = (
            SparseMoE(cfg.hidden_size, cfg.moe, tp, dtype, device, ops)
            if sparse and cfg.moe is not None
            else LlamaMLP(cfg, tp, dtype, device, ops)
        )
        self.sliding = sliding
        # Gemma 3 normalizes attention's output, and the MLP's input and output
        self.sandwich: tuple[RMSNorm, RMSNorm] | None = None
        if cfg.gemma is not None:
            self.pre_feedforward_layernorm = RMSNorm(cfg.hidden_size, eps, dtype, device, ops)
            self.post_feedforward_layernorm = RMSNorm(cfg.hidden_size, eps, dtype, device, ops)
            self.sandwich = (self.pre_feedforward_layernorm, self.post_feedforward_layernorm)

    def forward(
        self,
        x: torch.Tensor,
        rope: RotaryEmbedding,
        layer_kv: torch.Tensor,
        meta: StepMetadata,
    ) -> torch.Tensor:
        if self.sliding and meta.local is not None:
            meta = meta.local
        attended = self.self_attn(self.input_layernorm(x), rope, layer_kv, meta)
        if self.sandwich is None:
            x = x + attended
            y: torch.Tensor = x + self.mlp(self.post_attention_layernorm(x))
            return y
        pre, post = self.sandwich
        x = x + self.post_attention_layernorm(attended)
        out: torch.Tensor = x + post(self.mlp(pre(x)))
        return out


class LlamaModel(nn.Module):
    """A causal LM over a paged KV pool given as an argument; ``forward`` returns final hidden
    states, and ``logits`` projects only the rows a step samples."""

    def __init__(
        self,
        cfg: LlamaConfig,
        tp: TPContext | None = None,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        ops: RowOps | None = None,
    ) -> None:
        super().__init__()
        tp = tp or TPContext()
        dev = torch.device(device)
        self.cfg = cfg
        self.tp = tp
        self.dtype = dtype
        self.device = dev
        self.quant = Quant.NONE
        # the streams entering these layers (0: embeddings) are the drafter's features; (): final
        self.feature_layers: tuple[int, ...] = ()
        self.num_kv_heads_local = tp.shard(cfg.num_kv_heads, "num_key_value_heads")
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp, dtype, dev)
        sparse = cfg.moe.sparse if cfg.moe is not None else (False,) * cfg.num_layers
        windows = cfg.layer_windows
        sliding = windows.sliding if windows is not None else (False,) * cfg.num_layers
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(cfg, tp, dtype, dev, ops=ops, sparse=s, sliding=w)
            for s, w in zip(sparse, sliding, strict=True)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, dev, ops)
        self.rope = RotaryEmbedding(
            cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta, dev, cfg.rope_scaling, ops
        )
        # Gemma 3's sliding layers rotate by their own base; its embeddings scale by sqrt(hidden)
        self.rope_local: RotaryEmbedding | None = None
        if windows is not None and windows.local_rope_theta is not None:
            self.rope_local = RotaryEmbedding(
                cfg.head_dim, cfg.max_position_embeddings, windows.local_rope_theta, dev, None, ops
            )
        self.embed_scale = cfg.hidden_size**0.5 if cfg.gemma is not None else None
        self.lm_head = (
            self.embed_tokens
            if cfg.tie_word_embeddings
            else VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp, dtype, dev)
        )

    @torch.inference_mode()
    def forward(
        self, input_ids: torch.Tensor, kv_pool: torch.Tensor, meta: StepMetadata
    ) -> torch.Tensor:
        """input_ids: [T]; kv_pool: [layers, NB, 2, Hkv_local, BS, D] -> [T, hidden]."""
        return self.forward_with_features(input_ids, kv_pool, meta)[0]

    @torch.inference_mode()
    def forward_with_features(
        self, input_ids: torch.Tensor, kv_pool: torch.Tensor, meta: StepMetadata
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return self.run_layers(self.embed(input_ids), kv_pool, meta)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        x: torch.Tensor = self.embed_tokens(input_ids)
        if self.embed_scale is not None:  # the scale rounded to the dtype first, as Gemma's
            x = x * torch.tensor(self.embed_scale, dtype=x.dtype)
        return x

    @torch.inference_mode()
    def run_layers(
        self, x: torch.Tensor, kv_pool: torch.Tensor, meta: StepMetadata
    ) -> tuple[torch.Tensor, torch.Tensor]:
        taken: dict[int, torch.Tensor] = {}
        for i, layer in enumerate(self.layers):
            if i in self.feature_layers:
                taken[i] = x
            x = layer(x, self.rope, kv_pool[i], meta)
        y: torch.Tensor = self.norm(x)
        if not self.feature_layers:
            return y, y
        return y, torch.cat([taken[i] for i in self.feature_layers], dim=-1)

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head.logits(hidden).float()

    def quantize(self, kind: Quant) -> None:
        """After ``load_weights``; every TP rank must call it (row scales are a group max)."""
        quantize_layers(self, kind, tp_group(self.tp))
        self.lm_head.quantize(kind, keep_table=self.cfg.tie_word_embeddings)
        self.quant = kind

    def load_weights(
        self,
        weights: Mapping[str, Sliceable],
        quant: Quant = Quant.NONE,
        progress: Callable[[int, int], None] | None = None,
    ) -> None:
        """HF-named unsharded weights, each layer keeping its rank's shard. With ``quant`` each
        layer is quantized as it loads, so the host holds one full-precision layer at a time;
        TP ranks load in the same order so their row-scale reductions pair up. ``progress``
        hears (layers loaded, layers) after each."""

        def w(name: str) -> Sliceable:
            if name not in weights:
                raise KeyError(f"checkpoint has no tensor {name!r}")
            return weights[name]

        self.embed_tokens.load(w("model.embed_tokens.weight"))
        if not self.cfg.tie_word_embeddings:
            self.lm_head.load(w("lm_head.weight"))
            if isinstance(weights, PrequantizedCheckpoint) and weights.quantizes_input("lm_head"):
                raise ValueError("an activation-quantized lm_head is not implemented")
        # a pre-quantized checkpoint's stored kind is served in kernels; its head stays as stored
        prequantized = isinstance(weights, PrequantizedCheckpoint)
        if quant is not Quant.NONE and not prequantized:
            self.lm_head.quantize(quant, keep_table=self.cfg.tie_word_embeddings)
        self.norm.weight.data.copy_(norm_weight(w("model.norm.weight"), self.cfg))
        group = tp_group(self.tp)
        for i, layer in enumerate(self.layers):
            assert isinstance(layer, LlamaDecoderLayer)
            load_layer(layer, w, f"model.layers.{i}.", self.cfg)
            if isinstance(weights, PrequantizedCheckpoint) and quant is not Quant.FP8:
                # (the fp8 kernel quantizes its inputs per token itself)
                quantize_inputs(layer, weights, f"model.layers.{i}.")
            if quant is not Quant.NONE:
                quantize_layers(layer, quant, group)
            if progress is not None:
                progress(i + 1, len(self.layers))
        if self.device.type == "cuda" and quant is Quant.NONE:  # grouped expert matmuls
            for m in self.modules():
                if isinstance(m, SparseMoE):
                    m.stack_experts()
        self.quant = quant


def quantize_inputs(layer: LlamaDecoderLayer, weights: PrequantizedCheckpoint, prefix: str) -> None:
    """A W8A8 checkpoint's activation quantization, on the matmuls whose inputs it names."""
    attn, mlp = layer.self_attn, layer.mlp
    if isinstance(mlp, SparseMoE):
        experts = [m for m in weights.quantized if m.startswith(prefix) and ".experts." in m]
        if any(weights.quantizes_input(m) for m in experts):
            raise ValueError("activation-quantized (W8A8) experts are not implemented")
        matmuls = {"qkv_proj": attn.qkv_proj, "o_proj": attn.o_proj}
    else:
        matmuls = {
            "qkv_proj": attn.qkv_proj,
            "o_proj": attn.o_proj,
            "gate_up_proj": mlp.gate_up_proj,
            "down_proj": mlp.down_proj,
        }
    for name, linear in matmuls.items():
        linear.input_quant = weights.input_quant(prefix, name)


def quantize_layers(module: nn.Module, kind: Quant, group: object) -> None:
    for m in module.modules():
        if isinstance(m, RowParallelLinear):
            m.quantize(kind, group)
        elif isinstance(m, ServedLinear):
            m.quantize(kind)


def load_layer(
    layer: LlamaDecoderLayer, w: Callable[[str], Sliceable], prefix: str, cfg: LlamaConfig
) -> None:
    attn, mlp = layer.self_attn, layer.mlp
    qkv = ("q", "k", "v")
    sizes = (cfg.q_size, cfg.kv_size, cfg.kv_size)
    inter = cfg.intermediate_size
    if cfg.fused_projections:  # Phi-3: one tensor each, split as loaded
        attn.qkv_proj.load(split_rows(w(prefix + "self_attn.qkv_proj.weight"), sizes))
    else:
        attn.qkv_proj.load(
            [w(prefix + f"self_attn.{n}_proj.weight") for n in qkv],
            [w(prefix + f"self_attn.{n}_proj.bias") for n in qkv]
            if attn.qkv_proj.bias is not None
            else [],
        )
    if isinstance(mlp, SparseMoE):
        assert cfg.moe is not None
        mlp.load(w, prefix + cfg.moe.prefix)
    elif cfg.fused_projections:
        mlp.gate_up_proj.load(split_rows(w(prefix + "mlp.gate_up_proj.weight"), (inter, inter)))
        mlp.down_proj.load(w(prefix + "mlp.down_proj.weight"))
    else:
        mlp.gate_up_proj.load([w(prefix + f"mlp.{n}_proj.weight") for n in ("gate", "up")])
        mlp.down_proj.load(w(prefix + "mlp.down_proj.weight"))
    o_bias = w(prefix + "self_attn.o_proj.bias") if attn.o_proj.bias is not None else None
    attn.o_proj.load(w(prefix + "self_attn.o_proj.weight"), o_bias)
    if attn.sinks is not None:
        attn.sinks.data.copy_(attn.tp.narrow(w(prefix + "self_attn.sinks"), 0, "attention heads"))
    if attn.q_norm is not None and attn.k_norm is not None:
        attn.q_norm.weight.data.copy_(norm_weight(w(prefix + "self_attn.q_norm.weight"), cfg))
        attn.k_norm.weight.data.copy_(norm_weight(w(prefix + "self_attn.k_norm.weight"), cfg))
    if isinstance(layer.input_layernorm, RMSNorm):
        layer.input_layernorm.weight.data.copy_(
            norm_weight(w(prefix + "input_layernorm.weight"), cfg)
        )
    norm = norm_weight(w(prefix + "post_attention_layernorm.weight"), cfg)
    layer.post_attention_layernorm.weight.data.copy_(norm)
    if layer.sandwich is not None:
        for module, name in zip(layer.sandwich, ("pre", "post"), strict=True):
            module.weight.data.copy_(
                norm_weight(w(f"{prefix}{name}_feedforward_layernorm.weight"), cfg)
            )


def norm_weight(t: Sliceable, cfg: LlamaConfig) -> torch.Tensor:
    """An RMSNorm's weight as served: Gemma's scale by ``1 + weight`` (added in float32)."""
    return whole(t).float() + 1.0 if cfg.gemma is not None else whole(t)
