"""A checkpoint family other than Llama served end to end, exactly: a tiny random Mistral
checkpoint with a 64-position sliding window (the embedded model's tokenizer), served the way
``tandem serve --model DIR`` serves it, completes prompts that reach past its window with
transformers' greedy text, token for token (``bench.families``; the bench runs every family,
the engine-level check of each is ``tests/models/test_families.py``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from bench.families import served
from bench.family_checkpoints import family_checkpoint
from models.weights import resolve_checkpoint

pytestmark = [pytest.mark.ray, pytest.mark.slow]  # serves the checkpoint on a local Ray


def test_a_mistral_checkpoint_with_its_window_is_served_as_transformers_decodes_it(
    tmp_path: Path,
) -> None:
    embedded = resolve_checkpoint("embedded")
    vocab = json.loads((embedded / "config.json").read_text())["vocab_size"]
    folder = family_checkpoint(tmp_path / "mistral", "mistral-window", vocab, embedded)
    assert json.loads((folder / "config.json").read_text())["sliding_window"] == 64
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, vocab, (n,), generator=g).tolist() for n in (40, 90)]
    row = served("mistral-window", folder, prompts, max_tokens=24, port=8147)
    assert row["identical"] == row["prompts"] == 2
