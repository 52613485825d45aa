"""The Llama-family decoder over a paged KV cache, tensor-parallel by heads and MLP columns."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence

import torch
from torch import nn

from models.attention import StepMetadata, paged_attention
from models.config import LlamaConfig
from models.cpu_linear import CpuPacker
from models.cpu_paged import DTYPES as CPU_DTYPES
from models.cpu_paged import CpuPagedAttention
from models.cpu_program import LayerProgram
from models.cpu_rowops import CpuRowOps, attach
from models.flex_paged import FlexPagedAttention, FlexPool
from models.kv_layout import block_chunks
from models.layers import RMSNorm, RotaryEmbedding
from models.parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    ServedLinear,
    TPContext,
    VocabParallelEmbedding,
    tp_group,
)
from models.quant import Quant
from models.weights import Sliceable, whole


class LlamaAttention(nn.Module):
    def __init__(
        self,
        cfg: LlamaConfig,
        tp: TPContext,
        dtype: torch.dtype,
        device: torch.device,
        in_features: int | None = None,  # the input's width: hidden_size unless given
    ) -> None:
        super().__init__()
        self.num_heads = tp.shard(cfg.num_heads, "num_attention_heads")
        self.num_kv_heads = tp.shard(cfg.num_kv_heads, "num_key_value_heads")
        self.head_dim = cfg.head_dim
        self.scale = cfg.head_dim**-0.5
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
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, dtype, device)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, dtype, device)

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
            q = self.q_norm(qkv[:, :q_end].view(t, self.num_heads, self.head_dim))  # per head
            k = self.k_norm(qkv[:, q_end:k_end].view(t, self.num_kv_heads, self.head_dim))
            q, k = rope(meta.cos, meta.sin, q), rope(meta.cos, meta.sin, k)
        else:  # the query and key heads rotated in one call
            qk = rope(meta.cos, meta.sin, qkv[:, :k_end].view(t, -1, self.head_dim))
            q, k = qk[:, : self.num_heads], qk[:, self.num_heads :]  # [T, Hq | Hkv, D]
        out = paged_attention(q, k, v, layer_kv, meta, self.scale)  # [T, Hq_local * D]
        y: torch.Tensor = self.o_proj(out)
        return y


class LlamaMLP(nn.Module):
    """The SiLU-gated MLP; on a CPU model the gated product is one call of
    ``models.cpu_rowops`` (``native``, set when the model is packed for the CPU)."""

    native: CpuRowOps | None = None

    def __init__(
        self, cfg: LlamaConfig, tp: TPContext, dtype: torch.dtype, device: torch.device
    ) -> None:
        super().__init__()
        inter = cfg.intermediate_size
        self.local_inter = tp.shard(inter, "intermediate_size")
        self.gate_up_proj = ColumnParallelLinear(cfg.hidden_size, [inter, inter], tp, dtype, device)
        self.down_proj = RowParallelLinear(inter, cfg.hidden_size, tp, dtype, device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)  # [T, 2 * inter_local]
        native = self.native
        if native is not None and native.takes(gate_up):
            act = native.silu_mul(gate_up, self.local_inter)  # [T, inter_local]
        else:
            gate, up = gate_up.split(self.local_inter, dim=-1)
            act = nn.functional.silu(gate) * up
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
    ) -> None:
        super().__init__()
        self.input_layernorm: nn.Module = (
            RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)
            if input_norm
            else nn.Identity()
        )
        self.self_attn = LlamaAttention(cfg, tp, dtype, device)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)
        self.mlp = LlamaMLP(cfg, tp, dtype, device)

    def forward(
        self,
        x: torch.Tensor,
        rope: RotaryEmbedding,
        layer_kv: torch.Tensor,
        meta: StepMetadata,
    ) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), rope, layer_kv, meta)
        y: torch.Tensor = x + self.mlp(self.post_attention_layernorm(x))
        return y


class LlamaModel(nn.Module):
    """A causal LM whose forward reads and writes a paged KV pool given as an argument.

    ``forward`` returns final hidden states (after the last norm) for every new token;
    ``logits`` projects the rows the caller asks for, so a step only pays the vocabulary
    projection where it samples.
    """

    def __init__(
        self,
        cfg: LlamaConfig,
        tp: TPContext | None = None,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        super().__init__()
        tp = tp or TPContext()
        dev = torch.device(device)
        self.cfg = cfg
        self.tp = tp
        self.dtype = dtype
        self.device = dev
        self.quant = Quant.NONE  # set by quantize() or load_weights(quant=...)
        # The residual stream entering these layers (0: the embeddings), concatenated per token,
        # is what the drafter reads as the target's features (an EAGLE-3 head: three of them);
        # empty: the final hidden state (EAGLE-1/2). Set by ``runtime.shard`` for the head it
        # co-hosts.
        self.feature_layers: tuple[int, ...] = ()
        self.num_kv_heads_local = tp.shard(cfg.num_kv_heads, "num_key_value_heads")
        self.paged_flex = FlexPagedAttention()  # in-place attention at long contexts (GPU)
        # in-place attention on a CPU, for every decode and verification (models.cpu_paged)
        self.paged_native = (
            CpuPagedAttention(cfg.num_heads // cfg.num_kv_heads, cfg.head_dim)
            if dev.type == "cpu" and dtype in CPU_DTYPES and cfg.head_dim % 16 == 0
            else None
        )
        self.packer = CpuPacker()  # matmuls on a CPU (models.cpu_linear), by pack_for_cpu
        self.packed_for_cpu = False
        self.program: LayerProgram | None = None  # decode steps' layers in one call, on a CPU
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp, dtype, dev)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(cfg, tp, dtype, dev) for _ in range(cfg.num_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, dev)
        self.rope = RotaryEmbedding(
            cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta, dev, cfg.rope_scaling
        )
        self.lm_head = (
            self.embed_tokens
            if cfg.tie_word_embeddings
            else VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp, dtype, dev)
        )

    @torch.inference_mode()
    def forward(
        self, input_ids: torch.Tensor, kv_pool: torch.Tensor, meta: StepMetadata
    ) -> torch.Tensor:
        """input_ids: [T]; kv_pool: [num_layers, num_blocks, 2, Hkv_local, block_size, D].

        Returns hidden states [T, hidden].
        """
        return self.forward_with_features(input_ids, kv_pool, meta)[0]

    @torch.inference_mode()
    def forward_with_features(
        self, input_ids: torch.Tensor, kv_pool: torch.Tensor, meta: StepMetadata
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``forward``, also returning the drafter's features of every new token: [T, hidden]
        final hidden states, [T, F] features (``feature_layers``; F = hidden without them)."""
        x = self.embed_tokens(input_ids)
        program = self.program
        if program is not None and not self.feature_layers and program.run(x, kv_pool, meta):
            out: torch.Tensor = self.norm(x)  # x: the last layer's output, updated in place
            return out, out
        taken: dict[int, torch.Tensor] = {}
        for i, layer in enumerate(self.layers):
            if i in self.feature_layers:
                taken[i] = x
            x = layer(x, self.rope, kv_pool[i], meta)
        y: torch.Tensor = self.norm(x)
        if not self.feature_layers:
            return y, y
        return y, torch.cat([taken[i] for i in self.feature_layers], dim=-1)

    @property
    def invariant_attention(self) -> bool:
        """Whether attention runs in float64 (``build_attention_metadata``): on a CPU, for a
        model whose activations are rounded to 16 bits (bf16 or fp16 weights, or quantized
        ones), so that greedy speculation stays token-identical to plain decoding. It applies
        to the groups that gather (every group where the CPU kernel is unavailable, or chunks
        over its ``max_new_tokens``): the kernel of ``models.cpu_paged`` is batch-invariant at
        the model's dtype."""
        return self.device.type == "cpu" and (
            self.dtype != torch.float32 or self.quant is not Quant.NONE
        )

    def attention_path(self) -> tuple[str, int]:
        """What runs decode attention (``models.attention``), and the steps that gathered
        because the CPU kernel could not be built: for ``/health``."""
        native = self.paged_native
        if native is not None:
            return native.describe(), native.fallbacks
        if self.device.type == "cuda":
            return (
                "flex_paged in bucketed steps and long ragged ones, else gather",
                self.paged_flex.fallbacks,
            )
        return (
            f"gather (no cpu_paged kernel for {self.dtype} or head dim {self.cfg.head_dim})",
            0,
        )

    def flex_pool(self, kv_pool: torch.Tensor) -> FlexPool:
        """What the metadata builder needs to let long-context groups read ``kv_pool`` in
        place (``models.flex_paged``)."""
        return FlexPool(
            self.paged_flex,
            num_kv_heads=self.num_kv_heads_local,
            num_blocks=kv_pool.shape[1],
            group_size=self.cfg.num_heads // self.cfg.num_kv_heads,
            block_chunks=block_chunks(kv_pool[0]),
        )

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [N, hidden] -> float32 logits [N, vocab]."""
        return self.lm_head.logits(hidden).float()

    @torch.inference_mode()
    def head(
        self, hidden: torch.Tensor, argmax_only: Sequence[bool]
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """hidden: [N, hidden] -> float32 logits [N, vocab], and [N] int64 each row's
        ``argmax(-1)`` when some row asked for no more (``argmax_only``) and the head has a
        screen for it (``models.greedy_head``; else None). Those rows' logits are not
        computed: they read NaN. More such rows than the screen takes (``GreedyHead.takes``):
        the full head for every row, and None."""
        screen = self.lm_head.greedy
        n = hidden.shape[0]
        if screen is None or not any(argmax_only) or not screen.takes(sum(argmax_only)):
            return self.logits(hidden), None
        only = torch.tensor(list(argmax_only), dtype=torch.bool)  # [N]
        tokens = torch.empty(n, dtype=torch.long)
        tokens[only] = screen.argmax(hidden[only])
        if bool(only.all()):
            return torch.full((1, self.cfg.vocab_size), math.nan).expand(n, -1), tokens
        full = (~only).nonzero().flatten()
        logits = torch.full((n, self.cfg.vocab_size), math.nan)
        logits[full] = self.logits(hidden[full])
        tokens[full] = logits[full].argmax(dim=-1)
        return logits, tokens

    def pack_for_cpu(self) -> bool:
        """Pack every matmul weight for row-invariant matmuls on the CPU
        (``models.cpu_linear``), give the norms and rotary embedding their one-call kernel
        (``models.cpu_rowops``) and load the attention kernel (``models.cpu_paged``), so that
        ``/health`` names every path from start-up: for inference, after ``load_weights`` (and
        ``quantize``).
        False where the CPU has no such path for the matmuls; ``matmul_path`` says which it
        took."""
        if self.device.type != "cpu":
            return False
        layers = [m for m in self.modules() if isinstance(m, ServedLinear)]
        done = [m.pack_for_cpu(self.packer) for m in layers]
        head = self.lm_head.pack_for_cpu(self.packer)
        attach(self, CpuRowOps())  # norms, rotary embedding and the MLP's product, a call each
        if self.paged_native is not None:  # built now, not on the first request's step
            self.paged_native.ready()
        self.packed_for_cpu = True
        self.program = LayerProgram.build(self)  # last: it keeps the packed weights' pointers
        return all(done) and head

    def layers_path(self) -> str:
        """What runs the decoder layers of a step, for ``/health``: ``program`` (one C call,
        ``models.cpu_program``; steps it declines run the modules) or ``modules`` and why."""
        if self.program is not None and not self.feature_layers:
            return "program"
        return f"modules ({LayerProgram.why_not(self) or 'the program could not be built'})"

    def matmul_path(self) -> str:
        """What runs the matmuls, for ``/health``."""
        if self.packed_for_cpu:
            screen = self.lm_head.greedy
            if screen is None:
                return self.packer.describe()
            return (
                f"{self.packer.describe()}; greedy rows' argmax by a bf16 screen "
                f"({screen.screened} rows, {screen.fallbacks} fell back)"
            )
        return f"torch ({self.device.type})"

    def quantize(self, kind: Quant) -> None:
        """Quantize every matmul weight and the LM head (``models.quant``), after
        ``load_weights``; the embedding table stays plain for the lookup. Every rank of a TP
        group must call it (row scales are a max over the group)."""
        self.program = None  # it points at the weights quantizing replaces
        quantize_layers(self, kind, tp_group(self.tp))
        self.lm_head.quantize(kind, keep_table=self.cfg.tie_word_embeddings)
        self.quant = kind

    def load_weights(self, weights: Mapping[str, Sliceable], quant: Quant = Quant.NONE) -> None:
        """Load HF-named full (unsharded) weights; each layer reads and keeps its own rank's
        shard (lazy tensors are read only that far).

        With ``quant`` each decoder layer is quantized as soon as it is loaded, so the host
        never holds more than one layer in full precision beside the quantized ones: the
        layers' full-precision buffers are allocated up front but a page is resident only
        once a layer is read into it, and quantizing frees it. Quantizing after the whole
        load (``quantize``) instead needs the full-precision model in memory at once. Every
        rank of a TP group loads the layers in the same order, so the row-scale reductions
        pair up across ranks. ``ModelSpec.load`` has the freed pages go back to the system
        (``models.host_memory``)."""

        def w(name: str) -> Sliceable:
            if name not in weights:
                raise KeyError(f"checkpoint has no tensor {name!r}")
            return weights[name]

        self.embed_tokens.load(w("model.embed_tokens.weight"))
        if not self.cfg.tie_word_embeddings:
            self.lm_head.load(w("lm_head.weight"))
        if quant is not Quant.NONE:
            self.lm_head.quantize(quant, keep_table=self.cfg.tie_word_embeddings)
        self.norm.weight.data.copy_(whole(w("model.norm.weight")))
        group = tp_group(self.tp)
        for i, layer in enumerate(self.layers):
            assert isinstance(layer, LlamaDecoderLayer)
            load_layer(layer, w, f"model.layers.{i}.")
            if quant is not Quant.NONE:
                quantize_layers(layer, quant, group)
        self.quant = quant


def quantize_layers(module: nn.Module, kind: Quant, group: object) -> None:
    """Quantize the decoder layers' matmuls under ``module``; a row-parallel weight's rows
    are split over the TP ``group``, whose max gives each row its scale."""
    for m in module.modules():
        if isinstance(m, RowParallelLinear):
            m.quantize(kind, group)
        elif isinstance(m, ServedLinear):
            m.quantize(kind)


def load_layer(layer: LlamaDecoderLayer, w: Callable[[str], Sliceable], prefix: str) -> None:
    """Load one decoder layer from HF-named tensors under ``prefix`` (each rank its shard)."""
    attn, mlp = layer.self_attn, layer.mlp
    qkv = ("q", "k", "v")
    attn.qkv_proj.load(
        [w(prefix + f"self_attn.{n}_proj.weight") for n in qkv],
        [w(prefix + f"self_attn.{n}_proj.bias") for n in qkv]
        if attn.qkv_proj.bias is not None
        else [],
    )
    o_bias = w(prefix + "self_attn.o_proj.bias") if attn.o_proj.bias is not None else None
    attn.o_proj.load(w(prefix + "self_attn.o_proj.weight"), o_bias)
    if attn.q_norm is not None and attn.k_norm is not None:
        attn.q_norm.weight.data.copy_(whole(w(prefix + "self_attn.q_norm.weight")))
        attn.k_norm.weight.data.copy_(whole(w(prefix + "self_attn.k_norm.weight")))
    mlp.gate_up_proj.load([w(prefix + f"mlp.{n}_proj.weight") for n in ("gate", "up")])
    mlp.down_proj.load(w(prefix + "mlp.down_proj.weight"))
    if isinstance(layer.input_layernorm, RMSNorm):
        layer.input_layernorm.weight.data.copy_(whole(w(prefix + "input_layernorm.weight")))
    norm = whole(w(prefix + "post_attention_layernorm.weight"))
    layer.post_attention_layernorm.weight.data.copy_(norm)
