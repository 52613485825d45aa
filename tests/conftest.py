from __future__ import annotations

from pathlib import Path

import pytest
import torch

from models.spec import ModelSpec
from models.weights import resolve_checkpoint
from tests.helpers import cpu_has_bf16_dot, make_tiny_checkpoint

GPU_TESTS = Path(__file__).parent / "gpu"
_BF16_DESELECTED = pytest.StashKey[int]()


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects: every collected test is checked
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The `gpu` tier is the tests/gpu/ folder: a test in one and not the other fails collection.
    The `cpu_bf16` tier runs where the CPU has the instruction, as `gpu` runs where a GPU is."""
    wrong = [
        item.nodeid
        for item in items
        if (item.get_closest_marker("gpu") is not None) != item.path.is_relative_to(GPU_TESTS)
    ]
    if wrong:
        raise pytest.UsageError(
            "tests under tests/gpu/ must be marked gpu, and only they: " + ", ".join(wrong)
        )
    tiered = [item for item in items if item.get_closest_marker("cpu_bf16") is not None]
    if not tiered or cpu_has_bf16_dot():
        return
    config.hook.pytest_deselected(items=tiered)
    items[:] = [item for item in items if item.get_closest_marker("cpu_bf16") is None]
    config.stash[_BF16_DESELECTED] = len(tiered)


def pytest_terminal_summary(
    terminalreporter: pytest.TerminalReporter, config: pytest.Config
) -> None:
    n = config.stash.get(_BF16_DESELECTED, 0)
    if n:
        terminalreporter.write_line(
            f"cpu_bf16: {n} tests deselected: this CPU has no AVX-512 BF16 dot product"
        )


@pytest.fixture(scope="session", autouse=True)
def _threads() -> None:
    torch.set_num_threads(2)


@pytest.fixture(scope="session")
def embedded_folder() -> Path:
    """The embedded SmolLM2-135M-Instruct as an HF folder (dequantized once, then cached)."""
    return resolve_checkpoint("embedded")


@pytest.fixture(scope="session")
def tiny_folder(embedded_folder: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny"), embedded_folder, seed=1)


@pytest.fixture(scope="session")
def tiny_draft_folder(embedded_folder: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint(
        tmp_path_factory.mktemp("tiny_draft"),
        embedded_folder,
        seed=2,
        num_layers=1,
        hidden=32,
        heads=2,
        kv_heads=1,
    )


@pytest.fixture(scope="session")
def small_vocab(
    embedded_folder: Path, tmp_path_factory: pytest.TempPathFactory
) -> tuple[ModelSpec, ModelSpec]:
    """A target and a draft model over 64 tokens: sampled outputs repeat some tokens and not
    others (n-gram lookup matches at some positions and not at the next), and exactness tests
    see enough of each token."""
    t = make_tiny_checkpoint(
        tmp_path_factory.mktemp("t64"), embedded_folder, seed=11, vocab_size=64
    )
    d = make_tiny_checkpoint(
        tmp_path_factory.mktemp("d64"),
        embedded_folder,
        seed=12,
        vocab_size=64,
        num_layers=1,
        hidden=32,
        heads=2,
        kv_heads=1,
    )
    return ModelSpec(str(t)), ModelSpec(str(d))
