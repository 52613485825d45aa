"""Shared test helpers: tiny random checkpoints and small utilities (no downloads)."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch


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
