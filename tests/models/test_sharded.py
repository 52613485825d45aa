"""A checkpoint split into several safetensors shards with an index loads lazily, every TP rank
reading its slices from whichever shards hold them; a shard the index names but the folder
lacks is refused by name."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from models.kv_layout import kv_pool_shape
from models.spec import ModelSpec
from models.weights import INDEX, safetensors_files
from runtime.runner import LocalRunner, SeqInput
from tests.models.test_tensor_parallel import check_tp2_matches_tp1


@pytest.fixture(scope="module")
def sharded(tiny_folder: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    from transformers import LlamaForCausalLM

    folder = tmp_path_factory.mktemp("sharded")
    model = LlamaForCausalLM.from_pretrained(tiny_folder)
    model.save_pretrained(folder, max_shard_size="2MB")
    return folder


def _logits(spec: ModelSpec) -> torch.Tensor:
    model = spec.load()
    c = model.cfg
    pool = torch.zeros(kv_pool_shape(4, c.num_kv_heads, c.num_layers, 16, c.head_dim))
    return LocalRunner(model, pool, 16).run([SeqInput([0, 1], 0, list(range(3, 23)), [19])]).logits


def test_a_sharded_checkpoint_serves_the_same_model(tiny_folder: Path, sharded: Path) -> None:
    files = safetensors_files(sharded)
    assert len(files) >= 2 and (sharded / INDEX).exists()
    assert torch.equal(_logits(ModelSpec(str(sharded))), _logits(ModelSpec(str(tiny_folder))))
    check_tp2_matches_tp1(ModelSpec(str(sharded)))


def test_a_missing_shard_is_named(sharded: Path, tmp_path: Path) -> None:
    broken = tmp_path / "broken"
    shutil.copytree(sharded, broken)
    lost = sorted(set(json.loads((broken / INDEX).read_text())["weight_map"].values()))[-1]
    (broken / lost).unlink()
    with pytest.raises(FileNotFoundError, match=lost):
        ModelSpec(str(broken)).load()
