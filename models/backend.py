"""How one model's steps run: its attention, forward and head, and what ``/health`` says."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence

import torch

from models.attention.backend import AttentionBackend
from models.attention.metadata import StepMetadata
from models.llama import LlamaModel


class ModelBackend(ABC):
    def __init__(self, model: LlamaModel, attention: AttentionBackend) -> None:
        self.model = model
        self.attention = attention

    @abstractmethod
    def forward(
        self, input_ids: torch.Tensor, kv_pool: torch.Tensor, meta: StepMetadata
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """[T, hidden] final hidden states, [T, F] the drafter's features."""

    @abstractmethod
    def head(
        self, hidden: torch.Tensor, argmax_only: Sequence[bool]
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """hidden: [N, H] -> fp32 logits [N, V], and [N] int64 argmax where ``argmax_only`` rows
        were computed without logits (those rows read NaN), else None."""

    @abstractmethod
    def describe(self) -> dict[str, str | int]:
        """For ``/health``: attention, attention_fallbacks, matmul, layers."""


class TorchBackend(ModelBackend):
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
