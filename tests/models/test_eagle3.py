"""EAGLE-3 heads in the published layout: the target's three residual streams against
transformers' hidden states, the head's paged forward against the published math written out
densely here, the config and layout variants heads ship in, and refusals by name."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from transformers import LlamaForCausalLM

from models.config import LlamaConfig
from models.cpu.backend import pack_eagle_head
from models.cpu.row_ops import CpuRowOps
from models.eagle import EagleConfig, EagleHead, default_aux_layers, load_eagle, save_random_eagle3
from models.kv_layout import kv_pool_shape
from models.spec import ModelSpec
from models.weights import load_state_dict
from runtime.runner import EagleRunner, LocalRunner, SeqInput
from tests.helpers import make_tiny_checkpoint

AUX = (1, 2, 3)  # streams entering layers 1, 2 and 3 of a 4-layer target
DRAFT_VOCAB = 4096


@pytest.fixture(scope="module")
def target_folder(embedded_folder: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("t4"), embedded_folder, 5, num_layers=4)


@pytest.fixture(scope="module")
def head_folder(target_folder: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_random_eagle3(
        target_folder,
        tmp_path_factory.mktemp("eagle3"),
        draft_vocab_size=DRAFT_VOCAB,
        aux_layers=AUX,
    )


def _ids(n: int, seed: int = 0) -> list[int]:
    return torch.randint(3, 40000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_target_features_are_transformers_residual_streams(target_folder: Path) -> None:
    """Feature id j is the residual stream entering target layer j (transformers'
    ``hidden_states[j]``), concatenated in the head's order."""
    model = ModelSpec(str(target_folder)).load("cpu")
    model.feature_layers = AUX
    c = model.cfg
    ids = _ids(40)
    pool = torch.zeros(kv_pool_shape(8, c.num_kv_heads, c.num_layers, 16, c.head_dim))
    out = LocalRunner(model, pool, 16).run([SeqInput([4, 1, 6], 0, ids, [39])])
    hf = LlamaForCausalLM.from_pretrained(target_folder, dtype=torch.float32).eval()
    with torch.no_grad():
        states = hf(torch.tensor([ids]), output_hidden_states=True).hidden_states
    want = torch.cat([states[j][0] for j in AUX], dim=-1)  # [T, 3H]
    assert out.all_hidden.shape == (40, 3 * c.hidden_size)
    assert (out.all_hidden - want).abs().max() <= 1e-4


def _rms(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return F.rms_norm(x, (x.shape[-1],), w, 1e-5)


def _rope(x: torch.Tensor, pos: torch.Tensor, theta: float) -> torch.Tensor:
    d = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d)
    ang = pos.float()[:, None] * inv[None]  # [T, D/2]
    cos, sin = ang.cos()[:, None], ang.sin()[:, None]
    a, b = x[..., : d // 2], x[..., d // 2 :]
    return torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1)


def _reference(
    w: dict[str, torch.Tensor], c: LlamaConfig, ids: list[int], g: torch.Tensor
) -> torch.Tensor:
    """The published EAGLE-3 layer over a whole sequence, densely: embeddings of ``ids`` and
    the head's input features ``g`` [T, H] (after fc) -> outputs before the final norm."""
    t = len(ids)
    emb = w["embed"][torch.tensor(ids)]
    x = torch.cat([_rms(emb, w["midlayer.input_layernorm.weight"]), _rms(g, w["hn"])], dim=-1)
    q = (x @ w["midlayer.self_attn.q_proj.weight"].T).view(t, c.num_heads, c.head_dim)
    k = (x @ w["midlayer.self_attn.k_proj.weight"].T).view(t, c.num_kv_heads, c.head_dim)
    v = (x @ w["midlayer.self_attn.v_proj.weight"].T).view(t, c.num_kv_heads, c.head_dim)
    pos = torch.arange(t)
    q, k = _rope(q, pos, c.rope_theta), _rope(k, pos, c.rope_theta)
    rep = c.num_heads // c.num_kv_heads
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    att = F.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True
    ).transpose(0, 1)  # [T, Hq, D]
    h = g + att.reshape(t, -1) @ w["midlayer.self_attn.o_proj.weight"].T
    m = _rms(h, w["midlayer.post_attention_layernorm.weight"])
    gate = m @ w["midlayer.mlp.gate_proj.weight"].T
    up = m @ w["midlayer.mlp.up_proj.weight"].T
    return h + (F.silu(gate) * up) @ w["midlayer.mlp.down_proj.weight"].T


def test_head_forward_is_the_published_math(target_folder: Path, head_folder: Path) -> None:
    head = load_eagle(head_folder, target_folder, torch.float32, "cpu", ops=CpuRowOps())
    assert pack_eagle_head(head)  # as a CPU runtime serves it
    c = head.cfg.layer
    w = dict(load_state_dict(head_folder))
    w["embed"] = load_state_dict(target_folder)["model.embed_tokens.weight"]
    w["hn"] = w["midlayer.hidden_norm.weight"]
    ids = _ids(20, seed=1)
    feats = torch.randn(20, 3 * c.hidden_size, generator=torch.Generator().manual_seed(2))
    g = feats @ w["fc.weight"].T
    want = _reference(w, c, ids, g)  # [T, H]

    pool = torch.zeros(kv_pool_shape(6, c.num_kv_heads, 1, 16, c.head_dim))
    runner = EagleRunner(head, pool, 16)
    # the target's features over a prompt, in two chunks (the head's paged KV carries over)
    a = runner.run([SeqInput([3, 5], 0, ids[:13], list(range(13)))], feats[:13])
    b = runner.run([SeqInput([3, 5], 13, ids[13:19], list(range(6)))], feats[13:19])
    got = torch.cat([a.hidden, b.hidden])
    assert (got - want[:19]).abs().max() <= 1e-4
    # a drafting round: the head's own prediction at 18 is the next position's input (no fc)
    own = runner.run([SeqInput([3, 5], 19, ids[19:], [0])], got[18:19], from_target=False)
    g_next = torch.cat([g[:19], got[18:19]])
    assert (own.hidden - _reference(w, c, ids, g_next)[19:]).abs().max() <= 1e-4

    # logits: the final norm, the reduced LM head, scattered to target ids through d2t
    small = _rms(want[:19], w["norm.weight"]) @ w["lm_head.weight"].T  # [19, Vd]
    target_ids = torch.arange(DRAFT_VOCAB) + w["d2t"]
    logits = torch.cat([a.logits, b.logits])
    assert (logits[:, target_ids] - small).abs().max() <= 1e-4
    others = torch.ones(head.cfg.vocab_size, dtype=torch.bool)
    others[target_ids] = False
    assert bool(torch.isneginf(logits[:, others]).all())
    assert bool(w["t2d"][target_ids].all()) and int(w["t2d"].sum()) == DRAFT_VOCAB


def test_layouts_heads_ship_in(target_folder: Path, head_folder: Path, tmp_path: Path) -> None:
    """``model.``-prefixed and ``layers.0``-named tensors, a ``speculators`` config (the layer's
    sizes nested), and aux ids at the top level all load to the same head."""
    base = load_eagle(head_folder, target_folder, torch.float32, "cpu")
    raw = json.loads((head_folder / "config.json").read_text())
    assert raw["architectures"] == ["LlamaForCausalLMEagle3"]
    tensors = load_state_dict(head_folder)
    assert "midlayer.hidden_norm.weight" in tensors and "fc.weight" in tensors
    from safetensors.torch import save_file

    other = tmp_path / "speculators"
    other.mkdir()
    renamed = {"model." + k.replace("midlayer.", "layers.0."): v for k, v in tensors.items()}
    save_file(renamed, str(other / "model.safetensors"))
    layer_keys = ("hidden_size", "intermediate_size", "num_attention_heads", "head_dim")
    nested = {k: raw[k] for k in (*layer_keys, "num_key_value_heads", "rms_norm_eps")}
    nested |= {"model_type": "llama", "vocab_size": raw["vocab_size"], "num_hidden_layers": 1}
    config = {
        "speculators_model_type": "eagle3",
        "architectures": ["Eagle3Speculator"],
        "transformer_layer_config": nested,
        "draft_vocab_size": DRAFT_VOCAB,
        "target_hidden_size": raw["target_hidden_size"],
        "eagle_aux_hidden_state_layer_ids": list(AUX),
    }
    (other / "config.json").write_text(json.dumps(config))
    again = load_eagle(other, target_folder, torch.float32, "cpu")
    assert again.cfg.eagle3 and again.cfg.aux_layers == AUX
    for (name, p), (_, q) in zip(base.named_parameters(), again.named_parameters(), strict=True):
        assert torch.equal(p, q), name
    assert torch.equal(base.d2t, again.d2t)


def test_streams_default_and_mismatches_are_refused_by_name(head_folder: Path) -> None:
    cfg = EagleConfig.from_folder(head_folder)
    target = cfg.layer
    deep = replace(target, num_layers=32)
    assert replace(cfg, aux_layers=None).for_target(deep).aux_layers == (2, 16, 29)
    assert default_aux_layers(32) == (2, 16, 29)
    with pytest.raises(ValueError, match="eagle_aux_hidden_state_layer_ids"):
        replace(cfg, aux_layers=None).for_target(replace(target, num_layers=2))  # (2, 1, -1)
    with pytest.raises(ValueError, match="eagle_aux_hidden_state_layer_ids"):
        replace(cfg, aux_layers=(1, 2, 4)).for_target(replace(target, num_layers=4))
    with pytest.raises(ValueError, match="target_hidden_size"):
        cfg.for_target(replace(target, num_layers=4, hidden_size=2 * target.hidden_size))


def test_an_eagle3_head_is_not_mistaken_for_eagle1(head_folder: Path) -> None:
    head = EagleHead(EagleConfig.from_folder(head_folder))
    assert head.fc.in_features == 3 * head.cfg.layer.hidden_size  # the streams alone
    assert head.cfg.final_norm and not head.cfg.fc_bias
