"""Dense, differentiable EAGLE-head forward over whole sequences from the serving head's own
parameters (so a head trained here serves unchanged), the distillation losses and acceptance.
Head position ``s`` reads ``f_s`` and ``x_{s+1}``; its output ``g_s`` should be ``f_{s+1}``."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from models.acceptance import overlap
from models.eagle import Eagle3Layer, EagleHead
from models.layers import RMSNorm, RotaryEmbedding, rotary_tables
from models.llama import LlamaAttention, LlamaDecoderLayer, LlamaMLP
from models.sampling import SamplingParams, probs_from_logits


def trainable_parameters(head: EagleHead) -> list[nn.Parameter]:
    """The parameters the checkpoint ships, set to require gradients (embeddings stay frozen)."""
    mods: list[nn.Module] = [head.fc, head.layer, head.norm]
    if head.cfg.draft_vocab_size != head.cfg.vocab_size:
        mods.append(head.lm_head)
    params = [p for m in mods for p in m.parameters()]
    for p in params:
        p.requires_grad_(True)
    return params


def unrolled_mask(seq_len: int, depth: int, device: torch.device) -> torch.Tensor:
    """[T, depth * T] bool: a depth-``d`` query ``s`` sees depth-1 keys ``j <= s - d + 1`` and the
    depth-``k`` key ``j = s - d + k``, the context of a draft chain started at ``s - d + 1``."""
    s = torch.arange(seq_len, device=device).unsqueeze(1)
    j = torch.arange(seq_len, device=device).unsqueeze(0)
    blocks = [j <= s - depth + 1] + [j == s - depth + k for k in range(2, depth + 1)]
    return torch.cat(blocks, dim=1)


def dense_attention_mlp(
    attn: LlamaAttention,
    mlp: LlamaMLP,
    post_norm: RMSNorm,
    rope: RotaryEmbedding,
    x: torch.Tensor,
    residual: torch.Tensor,
    keys: list[torch.Tensor],
    values: list[torch.Tensor],
    mask: torch.Tensor | None,
) -> torch.Tensor:
    """Attention and MLP of a decoder layer over whole sequences. x: [B, T, In] normed input;
    residual: [B, T, H]. Appends K, V [B, Hkv, T, D] to ``keys``/``values`` and attends over all
    of them: causally when ``mask`` is None, else where ``mask`` [T, len(keys) * T] is True."""
    b, t, _ = x.shape
    hq, hkv, hd = attn.num_heads, attn.num_kv_heads, attn.head_dim
    cos, sin = rotary_tables(rope.cos, rope.sin, torch.arange(t, device=x.device))
    q, k, v = attn.qkv_proj(x).split([hq * hd, hkv * hd, hkv * hd], -1)
    q = rope(cos, sin, q.view(b, t, hq, hd)).transpose(1, 2)  # [B, Hq, T, D]
    keys.append(rope(cos, sin, k.view(b, t, hkv, hd)).transpose(1, 2))  # [B, Hkv, T, D]
    values.append(v.view(b, t, hkv, hd).transpose(1, 2))
    o = F.scaled_dot_product_attention(
        q,
        torch.cat(keys, dim=2),
        torch.cat(values, dim=2),
        attn_mask=mask,
        is_causal=mask is None,
        scale=attn.scale,
        enable_gqa=hq != hkv,
    )
    h = residual + attn.o_proj(o.transpose(1, 2).reshape(b, t, hq * hd))
    out: torch.Tensor = h + mlp(post_norm(h))
    return out


def dense_layer(
    layer: LlamaDecoderLayer | Eagle3Layer,
    rope: RotaryEmbedding,
    x: torch.Tensor,
    keys: list[torch.Tensor],
    values: list[torch.Tensor],
    mask: torch.Tensor | None,
    embeds: torch.Tensor | None = None,
) -> torch.Tensor:
    """One head layer over whole sequences. Llama: x [B, T, H]; EAGLE-3: ``embeds`` and x = g
    [B, T, H], input ``[input_layernorm(embeds); hidden_norm(g)]``, residual g (or its norm)."""
    post = layer.post_attention_layernorm
    assert isinstance(post, RMSNorm)
    if isinstance(layer, Eagle3Layer):
        assert embeds is not None
        normed = layer.hidden_norm(x)
        residual = normed if layer.norm_before_residual else x
        inp = torch.cat([layer.input_layernorm(embeds), normed], dim=-1)  # [B, T, 2H]
        return dense_attention_mlp(
            layer.self_attn, layer.mlp, post, rope, inp, residual, keys, values, mask
        )
    assert isinstance(layer.mlp, LlamaMLP)  # a head's layer is dense
    return dense_attention_mlp(
        layer.self_attn,
        layer.mlp,
        post,
        rope,
        layer.input_layernorm(x),
        x,
        keys,
        values,
        mask,
    )


def unrolled_forward(
    head: EagleHead, ids: torch.Tensor, feats: torch.Tensor, depth: int
) -> list[torch.Tensor]:
    """ids: [B, T] tokens ``x_{s+1}``; feats: [B, T, F] features ``f_s`` (F = H, or 3H for
    EAGLE-3). Returns per depth [B, T, H] the predicted features, before the final norm."""
    layer = head.layer
    assert isinstance(layer, LlamaDecoderLayer | Eagle3Layer)
    emb = head.embed_tokens(ids)
    keys: list[torch.Tensor] = []
    values: list[torch.Tensor] = []
    outs: list[torch.Tensor] = []
    f = feats.to(head.dtype)
    for d in range(1, depth + 1):
        if d > 1:  # position s reads the previous depth's prediction made at s - 1
            f = torch.cat([torch.zeros_like(outs[-1][:, :1]), outs[-1][:, :-1]], dim=1)
        mask = None if d == 1 else unrolled_mask(ids.shape[1], d, ids.device)
        if isinstance(layer, Eagle3Layer):  # fc maps the target's streams; own g passes as is
            g = head.fc(f) if d == 1 else f
            outs.append(dense_layer(layer, head.rope, g, keys, values, mask, emb))
        else:
            x = head.fc(torch.cat([emb, f], dim=-1))
            outs.append(dense_layer(layer, head.rope, x, keys, values, mask))
    return outs


def draft_logits(head: EagleHead, hidden: torch.Tensor) -> torch.Tensor:
    """hidden: [..., H] -> float32 logits over the head's own (possibly reduced) vocabulary."""
    out: torch.Tensor = head.lm_head(head.norm(hidden)).float()
    return out


@dataclass(frozen=True)
class LossWeights:
    regression: float = 1.0  # smooth L1 of g_s against f_{s+1}
    distribution: float = 0.1  # KL from the target's distribution of x_{s+2} to the head's
    depth_decay: float = 0.8


@dataclass(frozen=True)
class LossParts:
    total: torch.Tensor
    regression: tuple[float, ...]
    kl: tuple[float, ...]  # KL(p || q) over the draft vocabulary, nats
    top1: tuple[float, ...]


def distill_loss(
    head: EagleHead,
    outs: Sequence[torch.Tensor],
    next_feats: torch.Tensor,
    target_rows: torch.Tensor,
    mask: torch.Tensor,
    weights: LossWeights,
) -> LossParts:
    """outs: per depth [B, T, H]; next_feats: [B, T, H] the true ``f_{s+1}``; target_rows:
    [V_draft, H], whose ``softmax(target_rows @ f_{s+1})`` over the draft vocabulary is the label
    (as EAGLE-3); mask: [B, T] 1.0 where position ``s`` has a label."""
    nf = next_feats.float()
    with torch.autocast(nf.device.type, enabled=False):  # labels at full precision
        logp = torch.log_softmax(nf @ target_rows.float().t(), dim=-1)  # [B, T, V_draft]
    p = logp.exp()
    neg_entropy = (p * logp).sum(-1)  # [B, T], so that the KL below is 0 at a perfect fit
    p_top = p.argmax(-1)
    total = nf.new_zeros(())
    regs, kls, tops = [], [], []
    for d, g in enumerate(outs):
        m = mask.clone()
        m[:, :d] = 0.0  # no chain reaches depth d + 1 before position d
        denom = m.sum().clamp_min(1.0)
        reg = F.smooth_l1_loss(g.float(), nf, reduction="none").mean(-1)
        logq = torch.log_softmax(draft_logits(head, g), dim=-1)  # [B, T, V_draft]
        kl = neg_entropy - (p * logq).sum(-1)
        step = ((weights.regression * reg + weights.distribution * kl) * m).sum() / denom
        total = total + weights.depth_decay**d * step
        with torch.no_grad():
            regs.append(float((reg * m).sum() / denom))
            kls.append(float((kl * m).sum() / denom))
            tops.append(float(((logq.argmax(-1) == p_top).float() * m).sum() / denom))
    return LossParts(total, tuple(regs), tuple(kls), tuple(tops))


def teacher_forced_overlap(
    draft_full_logits: torch.Tensor, target_logits: torch.Tensor, temperature: float
) -> torch.Tensor:
    """[N] acceptance probability of one draft token, ``sum_x min(p(x), q(x))`` under the same
    sampling transform (argmax agreement at temperature 0). Logits: [N, V], full vocabulary."""
    params = [SamplingParams(temperature=temperature)] * target_logits.shape[0]
    p = probs_from_logits(target_logits.float(), params)
    q = probs_from_logits(draft_full_logits.float(), params)
    return overlap(p, q)
