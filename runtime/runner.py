"""One forward step of a model over a ragged batch of sequences in a paged KV pool."""

from __future__ import annotations

import platform
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from models.attention.backend import AttentionBackend
from models.attention.metadata import SeqSlice
from models.backend import ModelBackend
from models.device_copy import to_device
from models.eagle import EagleHead
from models.llama import LlamaModel
from models.tree import TreeSpan, move_slots
from runtime.backends import attention_for, head_attention_spec, model_backend


@dataclass(frozen=True)
class SeqInput:
    """New tokens of one sequence, appended after ``num_cached`` tokens already in the pool."""

    block_table: Sequence[int]
    num_cached: int
    token_ids: Sequence[int]
    logit_positions: Sequence[int]  # indices into token_ids whose next-token logits are wanted
    tree: TreeSpan | None = None
    kv_moves: Sequence[tuple[int, int]] = ()
    # only the rows' argmax is read (greedy, no logprobs); not sent to TP ranks (no screen there)
    argmax_only: bool = False


@dataclass(frozen=True)
class StepResult:
    hidden: torch.Tensor  # [N, hidden] final hidden states at the requested positions
    # [N, vocab] fp32, batch then position order; NaN rows where ``tokens`` holds the argmax
    logits: torch.Tensor
    rows_per_seq: tuple[int, ...]
    # [T, F] drafter features per new token (EAGLE-3: ``LlamaModel.feature_layers``' streams)
    all_hidden: torch.Tensor
    tokens: torch.Tensor | None = None  # [N] int64 every row's argmax, where the head screened

    def argmax(self, rows: torch.Tensor | Sequence[int] | slice) -> torch.Tensor:
        if self.tokens is not None:
            return self.tokens[rows]
        # max's indices equal argmax's (first of ties, NaN above all) at a third of its CPU time
        return self.logits[rows].max(dim=-1).indices


def head_outputs(
    backend: ModelBackend, picked: torch.Tensor, batch: Sequence[SeqInput]
) -> tuple[torch.Tensor, torch.Tensor | None]:
    only = [s.argmax_only for s in batch for _ in s.logit_positions]
    return backend.head(picked, only)


def logit_rows(batch: Sequence[SeqInput], device: torch.device) -> torch.Tensor:
    rows: list[int] = []
    start = 0
    for s in batch:
        rows.extend(start + p for p in s.logit_positions)
        start += len(s.token_ids)
    return to_device(rows, device, torch.long)


def run_step(
    backend: ModelBackend,
    kv_pool: torch.Tensor,
    batch: Sequence[SeqInput],
    ids: torch.Tensor | None = None,
) -> StepResult:
    """Apply each sequence's ``kv_moves``, write its K/V into ``kv_pool``, return asked logits;
    ``ids``: [T] the tokens already on the device (``token_ids`` then only count them)."""
    model = backend.model
    dev = model.device
    block_size = backend.attention.spec.block_size
    for s in batch:
        move_slots(kv_pool, s.block_table, s.kv_moves, block_size)
    meta = backend.attention.plan(
        [SeqSlice(s.block_table, s.num_cached, len(s.token_ids), s.tree) for s in batch]
    )
    if ids is None:
        ids = to_device([t for s in batch for t in s.token_ids], dev, torch.long)  # [T]
    hidden, features = backend.forward(ids, kv_pool, meta)  # [T, hidden], [T, F]
    picked = hidden[logit_rows(batch, dev)]  # [N, hidden], N may be 0
    logits, tokens = head_outputs(backend, picked, batch)
    return StepResult(
        hidden=picked,
        logits=logits,
        rows_per_seq=tuple(len(s.logit_positions) for s in batch),
        all_hidden=features,
        tokens=tokens,
    )


def synchronize(device: torch.device | str) -> None:
    dev = torch.device(device)
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


class ModelRunner(ABC):
    """Forward steps of one model over its paged KV; logits come back full-vocabulary."""

    # whether ``run`` takes the step's tokens on the device (drafts or sampled tokens not read)
    takes_device_ids = False

    @abstractmethod
    def run(self, batch: Sequence[SeqInput], ids: torch.Tensor | None = None) -> StepResult:
        """One forward step over ``batch``; ``ids``: [T] its tokens on the device, where
        ``takes_device_ids`` (``token_ids`` then only count them)."""

    @abstractmethod
    def describe(self) -> dict[str, str | int]:
        """What runs the step here (``ModelBackend.describe``; a TP group: rank 0's)."""

    def rank0(self) -> ModelRunner:
        """The runner of this process's shard (a TP group's rank 0; else itself)."""
        return self


class LocalRunner(ModelRunner):
    """The whole model in this process; ``backend`` defaults to its modules in PyTorch ops."""

    takes_device_ids = True

    def __init__(
        self,
        model: LlamaModel,
        kv_pool: torch.Tensor,
        block_size: int,
        backend: ModelBackend | None = None,
    ) -> None:
        self.model = model
        self.kv_pool = kv_pool
        self.block_size = block_size
        self.backend = backend or model_backend(model, kv_pool, block_size, serve_cpu=False)

    def run(self, batch: Sequence[SeqInput], ids: torch.Tensor | None = None) -> StepResult:
        """``ids``: [T] the batch's tokens on the device, if they are there already."""
        return run_step(self.backend, self.kv_pool, batch, ids)

    def describe(self) -> dict[str, str | int]:
        return {
            "device": device_name(self.model.device),
            "torch": torch.__version__,
            **self.backend.describe(),
        }


def device_name(device: torch.device) -> str:
    """``cuda: NVIDIA H100 80GB HBM3`` or ``cpu: AMD EPYC``: what a replica's steps ran on."""
    if device.type == "cuda":
        return f"cuda: {torch.cuda.get_device_name(device)}"
    cpuinfo = Path("/proc/cpuinfo")
    lines = cpuinfo.read_text().splitlines() if cpuinfo.exists() else []
    model = next((ln.split(":", 1)[1].strip() for ln in lines if ln.startswith("model name")), "")
    return f"{device.type}: {model or platform.machine()}"


class EagleRunner:
    def __init__(
        self,
        head: EagleHead,
        kv_pool: torch.Tensor,
        block_size: int,
        attention: AttentionBackend | None = None,
    ) -> None:
        self.head = head
        self.kv_pool = kv_pool
        self.block_size = block_size
        self.attention = attention or attention_for(
            head_attention_spec(head, kv_pool, block_size), head.dtype
        )

    @torch.inference_mode()
    def run(
        self,
        batch: Sequence[SeqInput],
        features: torch.Tensor,
        from_target: bool = True,
        ids: torch.Tensor | None = None,
    ) -> StepResult:
        """features: [T, F] per new token, the target's (``from_target``) or the head's own;
        ``ids``: [T] the tokens already on the device (``token_ids`` then only count them)."""
        dev = self.head.device
        meta = self.attention.plan(
            [SeqSlice(s.block_table, s.num_cached, len(s.token_ids), s.tree) for s in batch]
        )
        if ids is None:
            ids = to_device([t for s in batch for t in s.token_ids], dev, torch.long)
        hidden = self.head(ids, features.to(dev), self.kv_pool, meta, from_target)  # [T, H]
        picked = hidden[logit_rows(batch, dev)]
        return StepResult(
            hidden=picked,
            logits=self.head.logits(picked),
            rows_per_seq=tuple(len(s.logit_positions) for s in batch),
            all_hidden=hidden,
        )
