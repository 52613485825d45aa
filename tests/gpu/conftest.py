"""The GPU tier (``make test-gpu`` on a machine with a CUDA GPU). ``TANDEM_TEST_DEVICE=cpu``
runs the same checks on the CPU, to dry-run them where no GPU is lent."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from models.eagle import save_random_eagle
from tests.helpers import make_tiny_checkpoint


@pytest.fixture(scope="session")
def device() -> str:
    return os.environ.get("TANDEM_TEST_DEVICE", "cuda")


@pytest.fixture(scope="session")
def gpu_target(embedded_folder: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random Llama big enough for real kernels: 4 layers, 512 wide, 8 query heads over 2 KV
    heads of 64, the embedded model's vocabulary."""
    return make_tiny_checkpoint(
        tmp_path_factory.mktemp("gpu") / "target",
        embedded_folder,
        seed=21,
        num_layers=4,
        hidden=512,
        heads=8,
        kv_heads=2,
        intermediate=1024,
    )


@pytest.fixture(scope="session")
def gpu_draft(embedded_folder: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint(
        tmp_path_factory.mktemp("gpu") / "draft",
        embedded_folder,
        seed=22,
        num_layers=1,
        hidden=128,
        heads=2,
        kv_heads=1,
    )


@pytest.fixture(scope="session")
def gpu_eagle(gpu_target: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_random_eagle(gpu_target, tmp_path_factory.mktemp("gpu") / "eagle")
