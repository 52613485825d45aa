"""An EAGLE-style draft head: the target's own features predict its next features.

At position ``t`` the head reads the target's final hidden state ``f_t`` and the embedding of
the next token ``x_{t+1}``, mixes them (``fc``: ``[embed; f] -> hidden``), runs one Llama
decoder layer over its own paged KV (a one-layer "draft" KV group), and produces ``g_t``, a
guess of ``f_{t+1}``. The target's LM head turns ``g_t`` into a distribution over ``x_{t+2}``.
Drafting several tokens feeds ``g_t`` back as the next feature.

Checkpoints use the published EAGLE layout, so a released head loads as is: ``config.json``
(Llama-style sizes; ``bias`` for the fc bias), and tensors ``fc.weight`` (``fc.bias``),
``layers.0.self_attn.{q,k,v,o}_proj.weight``, ``layers.0.mlp.{gate,up,down}_proj.weight``,
``layers.0.post_attention_layernorm.weight`` (the first layer has no input norm), optionally
``embed_tokens.weight`` (else the target's). EAGLE-3 style extras are understood too:
``norm.weight`` (a norm before the LM head) and a reduced draft vocabulary,
``lm_head.weight`` ``[V_draft, H]`` with ``d2t`` (draft id ``i`` is target id
``i + d2t[i]``); outside it the draft gives probability zero, which speculation's rule handles
exactly.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn

from models.config import LlamaConfig
from models.layers import RMSNorm, RotaryEmbedding
from models.llama import LlamaDecoderLayer, load_layer, quantize_layers
from models.parallel import ServedLinear, TPContext, linear, onednn_pack
from models.quant import Quant, QuantizedWeight, quantize, row_absmax
from models.weights import Sliceable, load_state_dict, open_checkpoint, whole


@dataclass(frozen=True)
class EagleConfig:
    layer: LlamaConfig  # the head's decoder layer (num_layers = 1), sizes of the target's
    vocab_size: int  # the target's vocabulary
    draft_vocab_size: int  # == vocab_size unless the head has a reduced vocabulary
    fc_bias: bool
    final_norm: bool  # EAGLE-3: a norm before the LM head

    @classmethod
    def from_folder(cls, folder: Path) -> EagleConfig:
        raw = json.loads((folder / "config.json").read_text())
        layer = LlamaConfig.from_hf_dict({**raw, "num_hidden_layers": 1})
        return cls(
            layer=layer,
            vocab_size=int(raw["vocab_size"]),
            draft_vocab_size=int(raw.get("draft_vocab_size", raw["vocab_size"])),
            fc_bias=bool(raw.get("bias", True)),
            final_norm=bool(raw.get("final_norm", False)),
        )

    def to_json(self) -> dict[str, object]:
        c = self.layer
        return {
            "architectures": ["EagleHead"],
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
            "bias": self.fc_bias,
            "final_norm": self.final_norm,
            "tie_word_embeddings": False,
        }


class EagleHead(nn.Module):
    def __init__(
        self, cfg: EagleConfig, dtype: torch.dtype = torch.float32, device: str = "cpu"
    ) -> None:
        super().__init__()
        c = cfg.layer
        dev = torch.device(device)
        self.cfg = cfg
        self.dtype = dtype
        self.device = dev
        self.embed_tokens = nn.Embedding(cfg.vocab_size, c.hidden_size, dtype=dtype, device=dev)
        self.fc = nn.Linear(
            2 * c.hidden_size, c.hidden_size, bias=cfg.fc_bias, dtype=dtype, device=dev
        )
        self.layer = LlamaDecoderLayer(c, TPContext(), dtype, dev, input_norm=False)
        self.norm: nn.Module = (
            RMSNorm(c.hidden_size, c.rms_norm_eps, dtype, dev) if cfg.final_norm else nn.Identity()
        )
        self.rope = RotaryEmbedding(
            c.head_dim, c.max_position_embeddings, c.rope_theta, dev, c.rope_scaling
        )
        self.lm_head = nn.Linear(
            c.hidden_size, cfg.draft_vocab_size, bias=False, dtype=dtype, device=dev
        )
        self.d2t: torch.Tensor
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.long, device=dev))
        for p in self.parameters():
            p.requires_grad_(False)
        # oneDNN reorderings (pack_for_cpu) or quantized copies (quantize) of fc and the LM
        # head for inference; the nn.Linear weights stay, for checkpoints and training
        self._packed_fc: torch.Tensor | None = None
        self._packed_head: torch.Tensor | None = None
        self._quant_fc: QuantizedWeight | None = None
        self._quant_head: QuantizedWeight | None = None

    def quantize(self, kind: Quant) -> None:
        """Quantize the head's matmuls (``models.quant``) for drafting, after loading."""
        quantize_layers(self.layer, kind, None)
        fc, head = self.fc.weight.data, self.lm_head.weight.data
        self._quant_fc = quantize(fc, kind, row_absmax(fc))
        self._quant_head = quantize(head, kind, row_absmax(head))

    def pack_for_cpu(self) -> bool:
        """Reorder the head's matmul weights for oneDNN (``models.parallel.onednn_pack``), for
        drafting on a CPU after loading (the head can then no longer be saved). False where the
        CPU has no such path."""
        if self.device.type != "cpu":
            return False
        layer = all(m.pack_for_cpu() for m in self.layer.modules() if isinstance(m, ServedLinear))
        if self._quant_fc is not None:  # quantized matmuls have their own kernel
            return layer
        self._packed_fc = onednn_pack(self.fc.weight.data)
        self._packed_head = onednn_pack(self.lm_head.weight.data)
        return layer and self._packed_fc is not None and self._packed_head is not None

    def forward(
        self, input_ids: torch.Tensor, features: torch.Tensor, kv_pool: torch.Tensor, meta: object
    ) -> torch.Tensor:
        """input_ids: [T] the tokens after each feature's position; features: [T, H];
        kv_pool: [1, num_blocks, 2, Hkv, block_size, D]. Returns predicted features [T, H]."""
        mixed = torch.cat([self.embed_tokens(input_ids), features.to(self.dtype)], dim=-1)
        x = linear(mixed, self.fc.weight, self._packed_fc, quantized=self._quant_fc)  # [T, H]
        if self.fc.bias is not None:
            x = x + self.fc.bias
        h: torch.Tensor = self.layer(x, self.rope, kv_pool[0], meta)
        return h

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [N, H] -> float32 logits over the target's vocabulary [N, V]."""
        normed = self.norm(hidden)
        small = linear(
            normed, self.lm_head.weight, self._packed_head, quantized=self._quant_head
        ).float()  # [N, V_draft]
        if self.cfg.draft_vocab_size == self.cfg.vocab_size:
            return small
        full = small.new_full((hidden.shape[0], self.cfg.vocab_size), float("-inf"))
        ids = torch.arange(self.cfg.draft_vocab_size, device=small.device) + self.d2t
        full[:, ids] = small
        return full

    def load(self, head: Mapping[str, torch.Tensor], target: Mapping[str, Sliceable]) -> None:
        """Load a head in the EAGLE layout, taking what it lacks (embeddings, a full-vocabulary
        LM head) from the target's weights (read lazily: only those tensors)."""
        h = {k.removeprefix("model."): v for k, v in head.items()}

        def w(name: str) -> torch.Tensor:
            return h[name].to(self.dtype)

        self.fc.weight.data.copy_(w("fc.weight"))
        if self.fc.bias is not None:
            self.fc.bias.data.copy_(
                w("fc.bias") if "fc.bias" in h else torch.zeros_like(self.fc.bias)
            )
        load_layer(self.layer, w, "layers.0.")
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
        """The head's own tensors in the EAGLE layout (not the target's embeddings; the LM head
        only when the vocabulary is reduced)."""
        layer = self.layer
        q, k, v = layer.self_attn.qkv_proj.weight.split(
            [self.cfg.layer.q_size, self.cfg.layer.kv_size, self.cfg.layer.kv_size]
        )
        gate, up = layer.mlp.gate_up_proj.weight.split(self.cfg.layer.intermediate_size)
        out = {
            "fc.weight": self.fc.weight,
            "layers.0.self_attn.q_proj.weight": q,
            "layers.0.self_attn.k_proj.weight": k,
            "layers.0.self_attn.v_proj.weight": v,
            "layers.0.self_attn.o_proj.weight": layer.self_attn.o_proj.weight,
            "layers.0.mlp.gate_proj.weight": gate,
            "layers.0.mlp.up_proj.weight": up,
            "layers.0.mlp.down_proj.weight": layer.mlp.down_proj.weight,
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


def save_eagle(head: EagleHead, folder: Path) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(head.cfg.to_json(), indent=2))
    save_file(head.state_for_checkpoint(), str(folder / "model.safetensors"))


def save_random_eagle(target_folder: Path, folder: Path, seed: int = 3) -> Path:
    """A randomly initialised one-layer head for the target in ``target_folder`` (its LM head
    the target's embedding), saved to ``folder``: for tests and benches where weights don't
    matter."""
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


def load_eagle(
    folder: Path,
    target_folder: Path,
    dtype: torch.dtype,
    device: str,
    quant: Quant = Quant.NONE,
) -> EagleHead:
    head = EagleHead(EagleConfig.from_folder(folder), dtype, device)
    head.load(load_state_dict(folder), open_checkpoint(target_folder))
    if quant is not Quant.NONE:
        head.quantize(quant)
    return head.eval()
