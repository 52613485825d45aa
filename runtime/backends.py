"""The backends a model runs with (attention, forward and head), chosen once per model."""

from __future__ import annotations

import torch

from models.attention.backend import AttentionBackend
from models.attention.flex import FlexBackend
from models.attention.layered import LayeredBackend
from models.attention.metadata import AttentionSpec
from models.attention.reference import ReferenceBackend
from models.backend import ModelBackend, TorchBackend
from models.cpu.attention import CpuAttentionBackend
from models.cpu.backend import CpuBackend
from models.cpu.linear import PanelUse
from models.cpu.paged import DTYPES as CPU_DTYPES
from models.cpu.row_ops import CpuRowOps
from models.eagle import EagleHead
from models.kv_layout import block_chunks
from models.layers import RotaryEmbedding, RowOps
from models.llama import LlamaModel
from models.quant import Quant


def row_ops_for(device: torch.device | str) -> RowOps:
    return CpuRowOps() if torch.device(device).type == "cpu" else RowOps()


def attention_spec(
    rope: RotaryEmbedding,
    heads: int,
    kv_heads: int,
    head_dim: int,
    kv_pool: torch.Tensor,
    block_size: int,
    window: int | None = None,
) -> AttentionSpec:
    """``heads``, ``kv_heads``: the whole model's; kv_pool: [layers, NB, 2, Hkv_local, BS, D]."""
    return AttentionSpec(
        block_size=block_size,
        group_size=heads // kv_heads,
        head_dim=head_dim,
        num_kv_heads=kv_pool.shape[3],
        num_blocks=kv_pool.shape[1],
        block_chunks=block_chunks(kv_pool[0]),
        rope_cos=rope.cos,
        rope_sin=rope.sin,
        device=rope.cos.device,
        window=window,
    )


def model_attention_spec(
    model: LlamaModel, kv_pool: torch.Tensor, block_size: int
) -> AttentionSpec:
    c = model.cfg
    return attention_spec(
        model.rope, c.num_heads, c.num_kv_heads, c.head_dim, kv_pool, block_size, c.sliding_window
    )


def head_attention_spec(head: EagleHead, kv_pool: torch.Tensor, block_size: int) -> AttentionSpec:
    c = head.cfg.layer
    return attention_spec(head.rope, c.num_heads, c.num_kv_heads, c.head_dim, kv_pool, block_size)


def attention_for(spec: AttentionSpec, dtype: torch.dtype, exact: bool = False) -> AttentionBackend:
    """The CPU kernel, flex on a GPU, else the reference path (in float64 where ``exact``)."""
    if spec.device.type == "cpu":
        if dtype in CPU_DTYPES and spec.head_dim % 16 == 0:
            return CpuAttentionBackend(spec, exact=exact)
        why = f"no cpu_paged kernel for {dtype} or head dim {spec.head_dim}"
        return ReferenceBackend(spec, exact=exact, why=why)
    if spec.device.type == "cuda":
        return FlexBackend(spec)
    return ReferenceBackend(spec, exact=exact)


def exact_attention(model: LlamaModel) -> bool:
    """A CPU model rounded to 16 bits attends in float64 so greedy speculation stays exact."""
    return model.device.type == "cpu" and (
        model.dtype != torch.float32 or model.quant is not Quant.NONE
    )


def model_attention(model: LlamaModel, kv_pool: torch.Tensor, block_size: int) -> AttentionBackend:
    """The model's attention: one backend, or one per kind of layer (Gemma 3, gpt-oss)."""
    exact = exact_attention(model)
    c = model.cfg

    def backend(spec: AttentionSpec) -> AttentionBackend:
        if c.attention_sinks:  # only the gather path's groups attend with sinks
            return ReferenceBackend(spec, exact=exact, why="attention sinks")
        return attention_for(spec, model.dtype, exact)

    attention = backend(model_attention_spec(model, kv_pool, block_size))
    if c.layer_windows is None:
        return attention
    rope = model.rope_local or model.rope
    local = attention_spec(
        rope, c.num_heads, c.num_kv_heads, c.head_dim, kv_pool, block_size, c.layer_windows.window
    )
    return LayeredBackend(attention, backend(local))


def model_backend(
    model: LlamaModel,
    kv_pool: torch.Tensor,
    block_size: int,
    serve_cpu: bool = True,
    panel: PanelUse | None = None,
) -> ModelBackend:
    """On a CPU with ``serve_cpu``, ``CpuBackend.apply`` (``panel``: see ``PanelUse``); else the
    modules in PyTorch ops."""
    attention = model_attention(model, kv_pool, block_size)
    if serve_cpu and model.device.type == "cpu":
        return CpuBackend.apply(model, attention, panel)
    return TorchBackend(model, attention)
