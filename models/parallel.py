"""Tensor-parallel linear layers that load their own shard and issue their own collective
(through a ``TPContext``, no globals); with ``world_size == 1`` they are plain layers."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn

from models.quant import Quant, quantize, row_absmax
from models.weights import Sliceable, whole


@dataclass(frozen=True)
class TPContext:
    rank: int = 0
    world_size: int = 1
    # a c10d group used through its own methods: several can live without a default group
    group: Any = None

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.world_size > 1:
            self.group.allreduce([x]).wait()
        return x

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        if self.world_size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.world_size)]
        self.group.allgather([parts], [x.contiguous()]).wait()
        return torch.cat(parts, dim=-1)

    def shard(self, size: int, what: str) -> int:
        if size % self.world_size:
            raise ValueError(
                f"{what}={size} is not divisible by tensor-parallel size {self.world_size}"
            )
        return size // self.world_size

    def narrow(self, w: Sliceable, dim: int, what: str) -> torch.Tensor:
        n = self.shard(w.shape[dim], what)
        return w.narrow(dim, self.rank * n, n)


class WeightKernel(Protocol):
    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x: [T, in] -> [T, out]."""


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    kernel: WeightKernel | None,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    if kernel is not None:
        return kernel.matmul(x, bias)
    return nn.functional.linear(x, weight, bias)


def tp_group(tp: TPContext) -> Any:
    return tp.group if tp.world_size > 1 else None


class ServedLinear(nn.Module):
    weight: nn.Parameter
    kernel: WeightKernel | None = None
    # a pre-quantized W8A8 checkpoint's activation quantization ([T, in] -> [T, in])
    input_quant: Callable[[torch.Tensor], torch.Tensor] | None = None

    def serve(self, kernel: WeightKernel) -> None:
        self.kernel = kernel
        self.weight = nn.Parameter(self.weight.data.new_empty(0), requires_grad=False)

    def quantize(self, kind: Quant, group: Any = None) -> None:
        """Per output channel over whole rows (``group``: the ranks holding the other columns)."""
        w = self.weight.data
        self.serve(quantize(w, kind, row_absmax(w, group)))

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if self.input_quant is not None:
            x = self.input_quant(x)
        return linear(x, self.weight, self.kernel, bias)


class ColumnParallelLinear(ServedLinear):
    """Output features split across ranks; merged outputs (q, k, v) each split separately."""

    def __init__(
        self,
        in_features: int,
        out_features: Sequence[int],
        tp: TPContext,
        dtype: torch.dtype,
        device: torch.device,
        bias: bool = False,
    ) -> None:
        super().__init__()
        self.tp = tp
        self.out_features = tuple(out_features)
        local = sum(tp.shard(o, "output features") for o in self.out_features)
        self.weight = nn.Parameter(
            torch.empty(local, in_features, dtype=dtype, device=device), requires_grad=False
        )
        self.bias: nn.Parameter | None = (
            nn.Parameter(torch.empty(local, dtype=dtype, device=device), requires_grad=False)
            if bias
            else None
        )

    def load(
        self, full_weights: Sequence[Sliceable], full_biases: Sequence[Sliceable] = ()
    ) -> None:
        parts = [self.tp.narrow(w, 0, "output features") for w in full_weights]
        self.weight.data.copy_(torch.cat(parts, dim=0))
        if self.bias is not None:
            biases = [self.tp.narrow(b, 0, "output features") for b in full_biases]
            self.bias.data.copy_(torch.cat(biases, dim=0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [T, in] -> [T, sum(out_i) / world_size]
        return self.matmul(x, self.bias)


class RowParallelLinear(ServedLinear):
    def __init__(
        self,
        in_features: int,
        out_features: int,
        tp: TPContext,
        dtype: torch.dtype,
        device: torch.device,
        bias: bool = False,
    ) -> None:
        super().__init__()
        self.tp = tp
        local_in = tp.shard(in_features, "input features")
        self.weight = nn.Parameter(
            torch.empty(out_features, local_in, dtype=dtype, device=device), requires_grad=False
        )
        self.bias: nn.Parameter | None = (
            nn.Parameter(torch.empty(out_features, dtype=dtype, device=device), requires_grad=False)
            if bias
            else None
        )

    def load(self, full_weight: Sliceable, full_bias: Sliceable | None = None) -> None:
        self.weight.data.copy_(self.tp.narrow(full_weight, 1, "input features"))
        if self.bias is not None:
            assert full_bias is not None
            self.bias.data.copy_(whole(full_bias))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [T, in / world_size] -> [T, out], summed over ranks; the bias added once, after
        y = self.tp.all_reduce(self.matmul(x))
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Module):
    """Token embedding with the vocabulary split across ranks; also serves as a tied LM head."""

    def __init__(
        self, vocab_size: int, hidden: int, tp: TPContext, dtype: torch.dtype, device: torch.device
    ) -> None:
        super().__init__()
        self.tp = tp
        self.kernel: WeightKernel | None = None
        self.vocab_local = tp.shard(vocab_size, "vocab_size")
        self.vocab_start = tp.rank * self.vocab_local
        self.weight = nn.Parameter(
            torch.empty(self.vocab_local, hidden, dtype=dtype, device=device), requires_grad=False
        )

    def load(self, full_weight: Sliceable) -> None:
        self.weight.data.copy_(self.tp.narrow(full_weight, 0, "vocab_size"))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp.world_size == 1:
            return nn.functional.embedding(ids, self.weight)
        local = ids - self.vocab_start
        outside = (local < 0) | (local >= self.vocab_local)
        out = nn.functional.embedding(local.masked_fill(outside, 0), self.weight)
        out.masked_fill_(outside.unsqueeze(-1), 0.0)
        return self.tp.all_reduce(out)

    def serve_logits(self, kernel: WeightKernel) -> None:
        self.kernel = kernel

    def quantize(self, kind: Quant, keep_table: bool) -> None:
        """For ``logits``; ``keep_table`` keeps the plain table for the lookup (tied)."""
        w = self.weight.data
        self.kernel = quantize(w, kind, row_absmax(w))
        if not keep_table:
            self.weight = nn.Parameter(w.new_empty(0), requires_grad=False)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        # hidden: [N, hidden] -> [N, vocab] (full vocabulary on every rank)
        local = linear(hidden, self.weight, self.kernel)
        return self.tp.all_gather_last(local)
