"""The EAGLE head: checkpoint round trip in the published layout, paged forward consistency,
int8 weights."""

from __future__ import annotations

from pathlib import Path

import torch

from models.config import LlamaConfig
from models.cpu.backend import pack_eagle_head
from models.cpu.row_ops import CpuRowOps
from models.eagle import EagleConfig, EagleHead, load_eagle, save_eagle
from models.kv_layout import kv_pool_shape
from models.quant import Quant
from models.weights import load_state_dict
from runtime.runner import EagleRunner, SeqInput


def _random_head(target: Path, draft_vocab: int | None = None) -> EagleHead:
    tc = LlamaConfig.from_folder(target)
    cfg = EagleConfig(
        layer=tc.__class__(**{**tc.__dict__, "num_layers": 1}),
        vocab_size=tc.vocab_size,
        draft_vocab_size=draft_vocab or tc.vocab_size,
        fc_bias=True,
        final_norm=draft_vocab is not None,
    )
    head = EagleHead(cfg)
    torch.manual_seed(0)
    for p in head.parameters():
        p.data.normal_(0, 0.05)
    if draft_vocab is not None:
        head.d2t.copy_(torch.arange(draft_vocab) * 3 - torch.arange(draft_vocab))  # ids 0, 3, 6..
    return head


def test_checkpoint_round_trip_and_paged_consistency(tiny_folder: Path, tmp_path: Path) -> None:
    head = _random_head(tiny_folder, draft_vocab=100)
    head.embed_tokens.weight.data.copy_(load_state_dict(tiny_folder)["model.embed_tokens.weight"])
    save_eagle(head, tmp_path / "eagle")
    saved = load_state_dict(tmp_path / "eagle")
    assert "embed_tokens.weight" not in saved and "layers.0.input_layernorm.weight" not in saved
    again = load_eagle(tmp_path / "eagle", tiny_folder, torch.float32, "cpu")
    c = head.cfg.layer
    ids = torch.randint(3, 200, (12,)).tolist()
    feats = torch.randn(12, c.hidden_size)

    def run(h: EagleHead, chunks: list[int]) -> torch.Tensor:
        pool = torch.zeros(kv_pool_shape(4, c.num_kv_heads, 1, 16, c.head_dim))
        runner, outs, done = EagleRunner(h, pool, 16), [], 0
        for n in chunks:
            r = runner.run(
                [SeqInput([2, 0], done, ids[done : done + n], list(range(n)))],
                feats[done : done + n],
            )
            outs.append(r.logits)
            done += n
        return torch.cat(outs)

    whole = run(head, [12])
    finite = torch.isfinite(whole)
    assert (run(again, [12])[finite] - whole[finite]).abs().max() <= 1e-5  # layout round-trips
    assert (run(head, [5, 1, 6])[finite] - whole[finite]).abs().max() <= 1e-4  # KV consistent
    packed = load_eagle(tmp_path / "eagle", tiny_folder, torch.float32, "cpu", ops=CpuRowOps())
    assert pack_eagle_head(packed)  # as a CPU runtime loads it: weights packed for the CPU
    assert (run(packed, [5, 1, 6])[finite] - whole[finite]).abs().max() <= 1e-4
    # int8 weights (models.quant): near the float32 head's logits, and not equal to them
    int8 = load_eagle(
        tmp_path / "eagle", tiny_folder, torch.float32, "cpu", Quant.INT8, CpuRowOps()
    )
    assert pack_eagle_head(int8)
    err = (run(int8, [5, 1, 6])[finite] - whole[finite]).abs()
    assert 0 < float(err.max()) <= 0.05 * float(whole[finite].abs().max())
    assert finite.sum(-1).tolist() == [100] * 12  # a reduced vocabulary: only its 100 ids
    assert bool(finite[:, 3].all()) and not bool(finite[:, 4].any())  # mapped through d2t
