"""How one model's steps run: its attention backend, its forward, its head, and what
``/health`` says of them. ``runtime.backends`` chooses one per model; ``models.cpu.backend``
is the CPU's, this module's ``TorchBackend`` everyone else's."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence

import torch

from models.attention.backend import AttentionBackend
from models.attention.metadata import StepMetadata
from models.llama import LlamaModel


class ModelBackend(ABC):
    """What runs ``model``'s forward and head over the pool its ``attention`` was made for."""

    def __init__(self, model: LlamaModel, attention: AttentionBackend) -> None:
        self.model = model
        self.attention = attention

    @abstractmethod
    def forward(
        self, input_ids: torch.Tensor, kv_pool: torch.Tensor, meta: StepMetadata
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``LlamaModel.forward_with_features``: [T, hidden] final hidden states, [T, F]
        the drafter's features."""

    @abstractmethod
    def head(
        self, hidden: torch.Tensor, argmax_only: Sequence[bool]
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """hidden: [N, hidden] -> float32 logits [N, vocab], and [N] int64 each row's argmax
        where the backend computed the rows that asked for no more (``argmax_only``) without
        their logits (those rows then read NaN); else None."""

    @abstractmethod
    def describe(self) -> dict[str, str | int]:
        """What runs the step, for ``/health``: ``attention``, ``attention_fallbacks``,
        ``matmul``, ``layers``."""


class TorchBackend(ModelBackend):
    """The model's own modules in PyTorch ops, around its attention backend."""

    def forward(
        self, input_ids: torch.Tensor, kv_pool: torch.Tensor, meta: StepMetadata
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return self.model.forward_with_features(input_ids, kv_pool, meta)

    def head(
        self, hidden: torch.Tensor, argmax_only: Sequence[bool]
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        return self.model.logits(hidden), None

    def describe(self) -> dict[str, str | int]:
        return {
            "attention": self.attention.describe(),
            "attention_fallbacks": self.attention.fallbacks,
            "matmul": f"torch ({self.model.device.type})",
            "layers": "modules",
        }
