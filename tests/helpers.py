"""Shared test helpers: tiny random checkpoints and small utilities (no downloads)."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from models.llama import LlamaModel


def make_tiny_checkpoint(
    folder: Path,
    tokenizer_from: Path,
    seed: int,
    num_layers: int = 2,
    hidden: int = 64,
    heads: int = 4,
    kv_heads: int = 2,
    vocab_size: int | None = None,
    tie: bool = True,
    intermediate: int | None = None,
) -> Path:
    """A randomly initialised Llama of the embedded model's family, with its tokenizer files
    (``intermediate``: the MLP's width, twice ``hidden`` unless given)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    tok_cfg = LlamaConfig.from_pretrained(tokenizer_from)
    cfg = LlamaConfig(
        vocab_size=vocab_size or tok_cfg.vocab_size,
        hidden_size=hidden,
        intermediate_size=intermediate or hidden * 2,
        num_hidden_layers=num_layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=hidden // heads,
        max_position_embeddings=2048,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=tie,
        bos_token_id=tok_cfg.bos_token_id,
        eos_token_id=tok_cfg.eos_token_id,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():
        for p in model.parameters():  # larger weights: sharper, more varied distributions
            if p.dim() == 2:
                p.normal_(0.0, 0.08)
    model.save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        src = tokenizer_from / name
        if src.exists():
            shutil.copy(src, folder / name)
    return folder


def assert_verification_equals_decodes(model: LlamaModel, n: int, k: int, blocks: int) -> None:
    """Verifying ``k`` tokens after an ``n``-token prompt gives each row the logits a one-token
    decode gives it, bit for bit: what keeps greedy speculation token-identical to plain
    decoding. ``blocks`` of 16 tokens must hold ``n + k``."""
    from models.kv_layout import kv_pool_shape
    from runtime.runner import SeqInput, run_step

    bs, c = 16, model.cfg
    g = torch.Generator().manual_seed(3)
    prompt = torch.randint(3, c.vocab_size, (n,), generator=g).tolist()
    tokens = torch.randint(3, c.vocab_size, (k,), generator=g).tolist()
    table = list(range(blocks))

    def fresh() -> torch.Tensor:
        shape = kv_pool_shape(blocks, c.num_kv_heads, c.num_layers, bs, c.head_dim)
        pool = torch.zeros(shape, dtype=model.dtype)
        run_step(model, pool, bs, [SeqInput(table, 0, prompt, [n - 1])])
        return pool

    pool = fresh()
    one_by_one = [
        run_step(model, pool, bs, [SeqInput(table, n + i, [t], [0])]).logits[0]
        for i, t in enumerate(tokens)
    ]
    pool = fresh()
    verified = run_step(model, pool, bs, [SeqInput(table, n, tokens, list(range(k)))]).logits
    for i in range(k):
        assert torch.equal(verified[i], one_by_one[i]), f"row {i} of {k}"
