"""Decode and verification steps at fixed shapes: persistent inputs, and CUDA graphs on a GPU.

A decode step of a small model is a few thousand small kernels; launched one by one from
Python they cost the GPU more time than they compute (the host is the bottleneck), and
rebuilding every index tensor on the host each step adds to it. ``BucketedRunner`` runs the
steps that ``runtime.step_buffers`` can lay out in a bucket (decodes and chain verifications)
through persistent buffers filled in place, with metadata computed on the device
(``models.attention.bucket_metadata``). On a GPU it captures the whole forward once per bucket
as a CUDA graph and replays it (``graphs=True``); elsewhere the same bucketed forward runs
eagerly. On a GPU a bucket over a long context reads the KV pool in place through
``flex_attention`` inside its graph (``models.flex_paged``), a short one gathers its blocks.
Prompt chunks, draft trees and steps beyond the buffers run the ragged path
(``runtime.runner.run_step``), counted in ``ragged_steps``.

Every rank of a TP group wraps its own shard the same way: the ranks see the same batch
(``runtime.step_wire``) and pick the same bucket. The decode engine asks for graphs with TP = 1
only: capturing a group's NCCL all-reduces in each rank's graph is how it would extend, and no
GPU has checked that yet, so a TP group runs its buckets eagerly.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from models.attention import bucket_metadata
from models.llama import LlamaModel
from models.tree import move_slots
from runtime.runner import LocalRunner, SeqInput, StepResult, head_outputs, run_step
from runtime.step_buffers import Bucket, StepBuffers

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Captured:
    graph: torch.cuda.CUDAGraph
    hidden: torch.Tensor  # [b * q, H] the graph's output buffers
    features: torch.Tensor  # [b * q, F]


class BucketedRunner(LocalRunner):
    """A ``LocalRunner`` whose bucketable steps run at fixed shapes (module docstring)."""

    def __init__(
        self,
        model: LlamaModel,
        kv_pool: torch.Tensor,
        block_size: int,
        max_seqs: int,
        max_query: int,
        max_blocks: int,
        graphs: bool = False,
        in_place_attention: bool | None = None,
    ) -> None:
        super().__init__(model, kv_pool, block_size)
        self.buffers = StepBuffers(max_seqs, max_query, max_blocks, block_size, model.device)
        self.graphs = graphs and model.device.type == "cuda"
        self._captured: dict[Bucket, _Captured] = {}
        self._graph_pool = torch.cuda.graph_pool_handle() if self.graphs else None
        # ``in_place_attention`` None: on a GPU a bucket's attention reads the pool in place
        # through flex_attention, while a CPU bucket takes the CPU kernel (``models.cpu_paged``);
        # False: the gather path everywhere (to compare against); True: flex on any device.
        if in_place_attention is None:
            in_place_attention = model.device.type == "cuda"
        self._flex = model.flex_pool(kv_pool) if in_place_attention else None
        self.bucketed_steps = 0
        self.ragged_steps = 0

    def run(self, batch: Sequence[SeqInput]) -> StepResult:
        if not self.buffers.fits(batch):
            self.ragged_steps += 1
            return run_step(self.model, self.kv_pool, self.block_size, batch)
        self.bucketed_steps += 1
        for s in batch:  # compaction owed by an accepted tree path: before the step's reads
            move_slots(self.kv_pool, s.block_table, s.kv_moves, self.block_size)
        filled = self.buffers.fill(batch)
        hidden, features = self._forward(filled.bucket)  # [b * q, H], [b * q, F]
        picked = hidden[self.buffers.logit_rows(filled)]  # [N, H]
        logits, tokens = head_outputs(self.model, picked, batch)
        return StepResult(
            hidden=picked,
            logits=logits,
            rows_per_seq=filled.rows_per_seq,
            all_hidden=features[self.buffers.token_rows(filled)],  # [T, F]
            tokens=tokens,
        )

    def _forward(self, bucket: Bucket) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.graphs:
            return self._static_forward(bucket)
        got = self._captured.get(bucket)
        if got is None:
            got = self._capture(bucket)
        got.graph.replay()
        return got.hidden, got.features

    def _static_forward(self, bucket: Bucket) -> tuple[torch.Tensor, torch.Tensor]:
        v = self.buffers.views(bucket)
        m = self.model
        meta = bucket_metadata(
            v.positions,
            v.slot_blocks,
            v.slot_offsets,
            v.write_rows,
            v.tables,
            v.cached,
            v.num_new,
            self.block_size,
            m.rope.cos,
            m.rope.sin,
            m.cfg.sliding_window,
            m.invariant_attention,
            m.paged_native,
            self._flex,
        )
        return m.forward_with_features(v.ids, self.kv_pool, meta)

    def _capture(self, bucket: Bucket) -> _Captured:
        """``_capture_once``; where in-place attention breaks the capture (an op that waits
        for the device, in a torch where ``flex_attention`` does), this runner's buckets
        gather from then on, logged and counted in the kernel's fallbacks, and the bucket is
        captured again."""
        try:
            return self._capture_once(bucket)
        except RuntimeError as e:
            if self._flex is None:
                raise
            log.error("graph capture with in-place attention failed, buckets gather: %s", e)
            kernel = self._flex.kernel
            kernel.failed = kernel.failed or f"graph capture: {e}"[:500]
            kernel.fallbacks += 1
            self._flex = None
            torch.cuda.synchronize(self.model.device)
            return self._capture_once(bucket)

    def _capture_once(self, bucket: Bucket) -> _Captured:
        """Warm the bucket up on a side stream, then capture its forward. The buffers hold the
        current step's inputs, so the warm-up and the capture compute this very step (their
        writes are the step's own K/V, written again when the graph replays)."""
        log.info(
            "capturing a CUDA graph for %d sequences x %d tokens over %d blocks",
            bucket.seqs,
            bucket.query,
            bucket.blocks,
        )
        side = torch.cuda.Stream(self.model.device)
        side.wait_stream(torch.cuda.current_stream(self.model.device))
        with torch.cuda.stream(side):
            for _ in range(2):
                self._static_forward(bucket)
        torch.cuda.current_stream(self.model.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._graph_pool):
            hidden, features = self._static_forward(bucket)
        got = _Captured(graph, hidden, features)
        self._captured[bucket] = got
        return got
