"""EAGLE draft heads: EAGLE-1/2 mix the target's final hidden state with the next embedding;
EAGLE-3 reads three residual streams (id j: the stream entering layer j). Draft id i is target id
``i + d2t[i]``; outside a reduced draft vocabulary the draft gives probability zero."""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn

from models.attention.metadata import StepMetadata
from models.checkpoint import open_weights
from models.config import LlamaConfig
from models.layers import RMSNorm, RotaryEmbedding, RowOps
from models.llama import LlamaAttention, LlamaDecoderLayer, LlamaMLP, load_layer, quantize_layers
from models.parallel import TPContext, WeightKernel, linear
from models.quant import Quant, quantize, row_absmax
from models.weights import Sliceable, load_state_dict, whole

EAGLE3_ARCHITECTURE = "LlamaForCausalLMEagle3"


def default_aux_layers(target_layers: int) -> tuple[int, int, int]:
    return (2, target_layers // 2, target_layers - 3)


@dataclass(frozen=True)
class EagleConfig:
    layer: LlamaConfig
    vocab_size: int
    draft_vocab_size: int  # == vocab_size unless the head has a reduced vocabulary
    fc_bias: bool
    final_norm: bool
    eagle3: bool = False
    # EAGLE-3: the target streams it reads (None: ``default_aux_layers`` of the target)
    aux_layers: tuple[int, ...] | None = None
    target_hidden_size: int = 0  # EAGLE-3: the target's width (fc reads 3 of it); 0: the head's
    norm_before_residual: bool = False  # EAGLE-3: the residual is hidden_norm(g), not g

    @classmethod
    def from_folder(cls, folder: Path) -> EagleConfig:
        raw = json.loads((folder / "config.json").read_text())
        if "transformer_layer_config" in raw:  # the "speculators" layout: the layer's sizes apart
            raw = {**raw, **raw["transformer_layer_config"]}
        eagle3 = EAGLE3_ARCHITECTURE in (raw.get("architectures") or []) or (
            raw.get("speculators_model_type") == "eagle3"
        )
        layer = LlamaConfig.from_hf_dict({**raw, "num_hidden_layers": 1})
        aux = raw.get("eagle_aux_hidden_state_layer_ids") or (raw.get("eagle_config") or {}).get(
            "eagle_aux_hidden_state_layer_ids"
        )
        return cls(
            layer=layer,
            vocab_size=int(raw.get("target_vocab_size", raw["vocab_size"])),
            draft_vocab_size=int(raw.get("draft_vocab_size") or raw["vocab_size"]),
            fc_bias=bool(raw.get("bias", not eagle3)),
            final_norm=eagle3 or bool(raw.get("final_norm", False)),
            eagle3=eagle3,
            aux_layers=tuple(int(i) for i in aux) if eagle3 and aux else None,
            target_hidden_size=int(raw.get("target_hidden_size") or layer.hidden_size),
            norm_before_residual=bool(raw.get("norm_before_residual", False)),
        )

    def for_target(self, target: LlamaConfig) -> EagleConfig:
        if not self.eagle3:
            return self
        aux = self.aux_layers or default_aux_layers(target.num_layers)
        if len(aux) != 3 or not all(0 <= i < target.num_layers for i in aux):
            raise ValueError(
                f"EAGLE-3 head reads target streams {aux}: it needs three of the target's "
                f"0..{target.num_layers - 1} (eagle_aux_hidden_state_layer_ids)"
            )
        if self.target_hidden_size != target.hidden_size:
            raise ValueError(
                f"EAGLE-3 head was made for a target {self.target_hidden_size} wide "
                f"(target_hidden_size); this target is {target.hidden_size}"
            )
        return replace(self, aux_layers=tuple(aux))

    @property
    def feature_width(self) -> int:
        return 3 * self.target_hidden_size if self.eagle3 else self.layer.hidden_size

    def to_json(self) -> dict[str, object]:
        c = self.layer
        layer = {
            "model_type": "llama",
            "hidden_size": c.hidden_size,
            "intermediate_size": c.intermediate_size,
            "num_attention_heads": c.num_heads,
            "num_key_value_heads": c.num_kv_heads,
            "head_dim": c.head_dim,
            "num_hidden_layers": 1,
            "rms_norm_eps": c.rms_norm_eps,
            "rope_theta": c.rope_theta,
            "rope_scaling": asdict(c.rope_scaling),
            "max_position_embeddings": c.max_position_embeddings,
            "vocab_size": self.vocab_size,
            "draft_vocab_size": self.draft_vocab_size,
            "tie_word_embeddings": False,
        }
        if self.eagle3:
            aux = list(self.aux_layers or ())
            return {
                "architectures": [EAGLE3_ARCHITECTURE],
                **layer,
                "target_hidden_size": self.target_hidden_size,
                "norm_before_residual": self.norm_before_residual,
                "eagle_config": {"eagle_aux_hidden_state_layer_ids": aux},
            }
        return {
            "architectures": ["EagleHead"],
            **layer,
            "bias": self.fc_bias,
            "final_norm": self.final_norm,
        }


class Eagle3Layer(nn.Module):
    """Attention over ``[input_layernorm(embed); hidden_norm(g)]``; residual g (or normed)."""

    def __init__(
        self,
        cfg: EagleConfig,
        dtype: torch.dtype,
        device: torch.device,
        tp: TPContext,
        ops: RowOps | None = None,
    ) -> None:
        super().__init__()
        c = cfg.layer
        h, eps = c.hidden_size, c.rms_norm_eps
        self.norm_before_residual = cfg.norm_before_residual
        self.input_layernorm = RMSNorm(h, eps, dtype, device, ops)
        self.hidden_norm = RMSNorm(h, eps, dtype, device, ops)
        self.self_attn = LlamaAttention(c, tp, dtype, device, in_features=2 * h, ops=ops)
        self.post_attention_layernorm = RMSNorm(h, eps, dtype, device, ops)
        self.mlp = LlamaMLP(c, tp, dtype, device, ops)

    def forward(
        self,
        embeds: torch.Tensor,
        g: torch.Tensor,
        rope: RotaryEmbedding,
        layer_kv: torch.Tensor,
        meta: StepMetadata,
    ) -> torch.Tensor:
        # embeds, g: [T, H] -> [T, H], the output before the head's final norm
        normed = self.hidden_norm(g)
        residual = normed if self.norm_before_residual else g
        x = torch.cat([self.input_layernorm(embeds), normed], dim=-1)
        x = residual + self.self_attn(x, rope, layer_kv, meta)
        y: torch.Tensor = x + self.mlp(self.post_attention_layernorm(x))
        return y

    def load(self, w: Callable[[str], Sliceable], prefix: str) -> None:
        attn = self.self_attn
        attn.qkv_proj.load([w(prefix + f"self_attn.{n}_proj.weight") for n in ("q", "k", "v")])
        attn.o_proj.load(w(prefix + "self_attn.o_proj.weight"))
        self.mlp.gate_up_proj.load([w(prefix + f"mlp.{n}_proj.weight") for n in ("gate", "up")])
        self.mlp.down_proj.load(w(prefix + "mlp.down_proj.weight"))
        for name in ("input_layernorm", "hidden_norm", "post_attention_layernorm"):
            norm = getattr(self, name)
            norm.weight.data.copy_(whole(w(prefix + f"{name}.weight")))

    def tensors(self, cfg: LlamaConfig, prefix: str) -> dict[str, torch.Tensor]:
        q, k, v = self.self_attn.qkv_proj.weight.split([cfg.q_size, cfg.kv_size, cfg.kv_size])
        gate, up = self.mlp.gate_up_proj.weight.split(cfg.intermediate_size)
        out = {
            "self_attn.q_proj.weight": q,
            "self_attn.k_proj.weight": k,
            "self_attn.v_proj.weight": v,
            "self_attn.o_proj.weight": self.self_attn.o_proj.weight,
            "mlp.gate_proj.weight": gate,
            "mlp.up_proj.weight": up,
            "mlp.down_proj.weight": self.mlp.down_proj.weight,
            "input_layernorm.weight": self.input_layernorm.weight,
            "hidden_norm.weight": self.hidden_norm.weight,
            "post_attention_layernorm.weight": self.post_attention_layernorm.weight,
        }
        return {prefix + k: t for k, t in out.items()}


class EagleHead(nn.Module):
    def __init__(
        self,
        cfg: EagleConfig,
        dtype: torch.dtype = torch.float32,
        device: str = "cpu",
        ops: RowOps | None = None,
    ) -> None:
        super().__init__()
        c = cfg.layer
        dev = torch.device(device)
        self.cfg = cfg
        self.dtype = dtype
        self.device = dev
        self.embed_tokens = nn.Embedding(cfg.vocab_size, c.hidden_size, dtype=dtype, device=dev)
        fc_in = cfg.feature_width + (0 if cfg.eagle3 else c.hidden_size)
        self.fc = nn.Linear(fc_in, c.hidden_size, bias=cfg.fc_bias, dtype=dtype, device=dev)
        self.layer: LlamaDecoderLayer | Eagle3Layer = (
            Eagle3Layer(cfg, dtype, dev, TPContext(), ops)
            if cfg.eagle3
            else LlamaDecoderLayer(c, TPContext(), dtype, dev, input_norm=False, ops=ops)
        )
        self.norm: nn.Module = (
            RMSNorm(c.hidden_size, c.rms_norm_eps, dtype, dev, ops)
            if cfg.final_norm
            else nn.Identity()
        )
        self.rope = RotaryEmbedding(
            c.head_dim, c.max_position_embeddings, c.rope_theta, dev, c.rope_scaling, ops
        )
        self.lm_head = nn.Linear(
            c.hidden_size, cfg.draft_vocab_size, bias=False, dtype=dtype, device=dev
        )
        self.d2t: torch.Tensor
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.long, device=dev))
        for p in self.parameters():
            p.requires_grad_(False)
        # fc and the LM head when quantized or packed; the nn.Linear weights stay for checkpoints
        self.fc_kernel: WeightKernel | None = None
        self.head_kernel: WeightKernel | None = None

    def quantize(self, kind: Quant) -> None:
        quantize_layers(self.layer, kind, None)
        fc, head = self.fc.weight.data, self.lm_head.weight.data
        self.fc_kernel = quantize(fc, kind, row_absmax(fc))
        self.head_kernel = quantize(head, kind, row_absmax(head))

    def forward(
        self,
        input_ids: torch.Tensor,
        features: torch.Tensor,
        kv_pool: torch.Tensor,
        meta: StepMetadata,
        from_target: bool = True,
    ) -> torch.Tensor:
        """input_ids: [T] the tokens after each feature's position; features: [T, F], the
        target's (F = ``cfg.feature_width``) or the head's own (F = H). Returns [T, H] predicted
        features, before the final norm."""
        embeds = self.embed_tokens(input_ids)
        features = features.to(self.dtype)
        if isinstance(self.layer, Eagle3Layer):
            g = self._fc(features) if from_target else features
            out: torch.Tensor = self.layer(embeds, g, self.rope, kv_pool[0], meta)
            return out
        x = self._fc(torch.cat([embeds, features], dim=-1))
        h: torch.Tensor = self.layer(x, self.rope, kv_pool[0], meta)
        return h

    def _fc(self, x: torch.Tensor) -> torch.Tensor:
        y = linear(x, self.fc.weight, self.fc_kernel)
        return y if self.fc.bias is None else y + self.fc.bias

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [N, H] -> float32 logits over the target's vocabulary [N, V]."""
        normed = self.norm(hidden)
        small = linear(normed, self.lm_head.weight, self.head_kernel).float()
        if self.cfg.draft_vocab_size == self.cfg.vocab_size:
            return small
        full = small.new_full((hidden.shape[0], self.cfg.vocab_size), float("-inf"))
        ids = torch.arange(self.cfg.draft_vocab_size, device=small.device) + self.d2t
        full[:, ids] = small
        return full

    def load(self, head: Mapping[str, torch.Tensor], target: Mapping[str, Sliceable]) -> None:
        """What the head lacks (embeddings, a full-vocabulary LM head) comes from the target."""
        h = {_published(k): v for k, v in head.items()}

        def w(name: str) -> torch.Tensor:
            if name not in h:
                raise KeyError(f"EAGLE head checkpoint has no tensor {name!r}")
            return h[name].to(self.dtype)

        self.fc.weight.data.copy_(w("fc.weight"))
        if self.fc.bias is not None:
            self.fc.bias.data.copy_(
                w("fc.bias") if "fc.bias" in h else torch.zeros_like(self.fc.bias)
            )
        if isinstance(self.layer, Eagle3Layer):
            self.layer.load(w, "layers.0.")
        else:
            load_layer(self.layer, w, "layers.0.", self.cfg.layer)
        emb = h.get("embed_tokens.weight")
        if emb is None:
            emb = whole(target["model.embed_tokens.weight"])
        self.embed_tokens.weight.data.copy_(emb.to(self.dtype))
        if "lm_head.weight" in h:
            self.lm_head.weight.data.copy_(w("lm_head.weight"))
        else:
            full = target.get("lm_head.weight", target["model.embed_tokens.weight"])
            self.lm_head.weight.data.copy_(whole(full).to(self.dtype))
        if "d2t" in h:
            self.d2t.copy_(h["d2t"].long())
        if isinstance(self.norm, RMSNorm):
            self.norm.weight.data.copy_(w("norm.weight"))

    def state_for_checkpoint(self) -> dict[str, torch.Tensor]:
        layer = self.layer
        if isinstance(layer, Eagle3Layer):
            assert isinstance(self.norm, RMSNorm)
            out = layer.tensors(self.cfg.layer, "midlayer.")
            out |= {
                "fc.weight": self.fc.weight,
                "norm.weight": self.norm.weight,
                "lm_head.weight": self.lm_head.weight,
                "d2t": self.d2t,
                "t2d": self._target_to_draft(),
            }
            return {k: t.detach().contiguous().cpu() for k, t in out.items()}
        q, k, v = layer.self_attn.qkv_proj.weight.split(
            [self.cfg.layer.q_size, self.cfg.layer.kv_size, self.cfg.layer.kv_size]
        )
        mlp = layer.mlp
        assert isinstance(mlp, LlamaMLP)  # a head's layer is dense
        gate, up = mlp.gate_up_proj.weight.split(self.cfg.layer.intermediate_size)
        out = {
            "fc.weight": self.fc.weight,
            "layers.0.self_attn.q_proj.weight": q,
            "layers.0.self_attn.k_proj.weight": k,
            "layers.0.self_attn.v_proj.weight": v,
            "layers.0.self_attn.o_proj.weight": layer.self_attn.o_proj.weight,
            "layers.0.mlp.gate_proj.weight": gate,
            "layers.0.mlp.up_proj.weight": up,
            "layers.0.mlp.down_proj.weight": mlp.down_proj.weight,
            "layers.0.post_attention_layernorm.weight": layer.post_attention_layernorm.weight,
        }
        if self.fc.bias is not None:
            out["fc.bias"] = self.fc.bias
        if isinstance(self.norm, RMSNorm):
            out["norm.weight"] = self.norm.weight
        if self.cfg.draft_vocab_size != self.cfg.vocab_size:
            out["lm_head.weight"] = self.lm_head.weight
            out["d2t"] = self.d2t
        return {k: t.detach().contiguous().cpu() for k, t in out.items()}

    def _target_to_draft(self) -> torch.Tensor:
        """[V] bool: which target ids the draft vocabulary holds (EAGLE-3's ``t2d``)."""
        mask = torch.zeros(self.cfg.vocab_size, dtype=torch.bool)
        ids = torch.arange(self.cfg.draft_vocab_size) + self.d2t.cpu()
        mask[ids] = True
        return mask


def _published(name: str) -> str:
    name = name.removeprefix("model.")
    return "layers.0." + name.removeprefix("midlayer.") if name.startswith("midlayer.") else name


def save_eagle(head: EagleHead, folder: Path) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(head.cfg.to_json(), indent=2))
    save_file(head.state_for_checkpoint(), str(folder / "model.safetensors"))


def save_random_eagle(target_folder: Path, folder: Path, seed: int = 3) -> Path:
    tc = LlamaConfig.from_folder(target_folder)
    cfg = EagleConfig(
        layer=replace(tc, num_layers=1),
        vocab_size=tc.vocab_size,
        draft_vocab_size=tc.vocab_size,
        fc_bias=True,
        final_norm=False,
    )
    head = EagleHead(cfg)
    torch.manual_seed(seed)
    for p in head.parameters():
        p.data.normal_(0, 0.05)
    head.lm_head.weight.data.copy_(load_state_dict(target_folder)["model.embed_tokens.weight"])
    save_eagle(head, folder)
    return folder


def save_random_eagle3(
    target_folder: Path,
    folder: Path,
    seed: int = 4,
    draft_vocab_size: int | None = None,
    aux_layers: tuple[int, ...] | None = None,
) -> Path:
    tc = LlamaConfig.from_folder(target_folder)
    vocab = draft_vocab_size or tc.vocab_size
    cfg = EagleConfig(
        layer=replace(tc, num_layers=1),
        vocab_size=tc.vocab_size,
        draft_vocab_size=vocab,
        fc_bias=False,
        final_norm=True,
        eagle3=True,
        aux_layers=aux_layers,
        target_hidden_size=tc.hidden_size,
    )
    head = EagleHead(cfg)
    g = torch.Generator().manual_seed(seed)
    for p in head.parameters():
        p.data.copy_(torch.randn(p.shape, generator=g) * 0.05)
    for norm in (head.layer.input_layernorm, head.layer.post_attention_layernorm, head.norm):
        assert isinstance(norm, RMSNorm)
        norm.weight.data.fill_(1.0)
    if vocab < tc.vocab_size:  # every other target id, from the start: offsets grow by one
        ids = torch.arange(vocab) * (tc.vocab_size // vocab)
        head.d2t.copy_(ids - torch.arange(vocab))
    save_eagle(head, folder)
    return folder


def load_eagle(
    folder: Path,
    target_folder: Path,
    dtype: torch.dtype,
    device: str,
    quant: Quant = Quant.NONE,
    ops: RowOps | None = None,
) -> EagleHead:
    cfg = EagleConfig.from_folder(folder).for_target(LlamaConfig.from_folder(target_folder))
    head = EagleHead(cfg, dtype, device, ops)
    head.load(load_state_dict(folder), open_weights(target_folder))
    if quant is not Quant.NONE:
        head.quantize(quant)
    return head.eval()
