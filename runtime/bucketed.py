"""Decodes and chain verifications at fixed shapes, one CUDA graph per bucket on a GPU (a TP
shard's NCCL all-reduces inside it, every rank capturing the same bucket in the same step; not
over quantized experts, which sync the host); other steps run ragged."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from models.backend import ModelBackend
from models.llama import LlamaModel
from models.moe import SparseMoE
from models.tree import move_slots
from runtime.graph_capture import capture
from runtime.runner import LocalRunner, SeqInput, StepResult, head_outputs, run_step
from runtime.step_buffers import Bucket, StepBuffers
from runtime.traffic_waits import TrafficWaits

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Captured:
    graph: torch.cuda.CUDAGraph
    hidden: torch.Tensor  # [b * q, H] the graph's output buffers
    features: torch.Tensor


class BucketedRunner(LocalRunner, TrafficWaits):
    def __init__(
        self,
        model: LlamaModel,
        kv_pool: torch.Tensor,
        block_size: int,
        max_seqs: int,
        max_query: int,
        max_blocks: int,
        graphs: bool = False,
        backend: ModelBackend | None = None,
    ) -> None:
        super().__init__(model, kv_pool, block_size, backend)
        self.buffers = StepBuffers(max_seqs, max_query, max_blocks, block_size, model.device)
        self.graphs = graphs and model.device.type == "cuda"
        if self.graphs and any(
            isinstance(m, SparseMoE) and m.gate_up is None for m in model.modules()
        ):  # quantized experts run one by one, counting their tokens on the host
            log.warning("quantized mixture-of-experts layers sync per layer: no CUDA graphs")
            self.graphs = False
        self._captured: dict[Bucket, _Captured] = {}
        self._graph_pool = torch.cuda.graph_pool_handle() if self.graphs else None
        self.bucketed_steps = 0
        self.ragged_steps = 0

    @property
    def compiles(self) -> int:
        return self.backend.attention.compiles

    @property
    def captures(self) -> int:
        return len(self._captured)

    def run(self, batch: Sequence[SeqInput], ids: torch.Tensor | None = None) -> StepResult:
        """``ids``: [T] the batch's tokens on the device already (drafts not read yet): put in
        the bucket's rows there."""
        if not self.buffers.fits(batch):
            self.ragged_steps += 1
            return run_step(self.backend, self.kv_pool, batch, ids)
        self.bucketed_steps += 1
        for s in batch:  # compaction owed by an accepted tree path: before the step's reads
            move_slots(self.kv_pool, s.block_table, s.kv_moves, self.block_size)
        filled = self.buffers.fill(batch)
        if ids is not None:
            self.buffers.put_ids(filled, ids)
        hidden, features = self._forward(filled.bucket)  # [b * q, H], [b * q, F]
        picked = hidden[self.buffers.logit_rows(filled)]  # [N, H]
        logits, tokens = head_outputs(self.backend, picked, batch)
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
        meta = self.backend.attention.plan_bucket(self.buffers.bucket_inputs(bucket))
        return self.backend.forward(self.buffers.views(bucket).ids, self.kv_pool, meta)

    def _capture(self, bucket: Bucket) -> _Captured:
        try:
            return self._capture_once(bucket)
        except RuntimeError as e:
            if not self.backend.attention.capture_failed(e):
                if self.model.tp.world_size > 1:
                    raise RuntimeError(
                        f"capturing a CUDA graph over TP rank {self.model.tp.rank}'s NCCL "
                        f"all-reduces failed ({e}); decode.step_shapes: ragged runs this "
                        "group without graphs"
                    ) from e
                raise
            torch.cuda.synchronize(self.model.device)
            return self._capture_once(bucket)

    def describe(self) -> dict[str, str | int]:
        """``graphs``: the buckets captured so far (each a CUDA graph), or ``off``; and the
        compiles and captures traffic has waited on (since ``serving``)."""
        graphs = f"{len(self._captured)} buckets captured" if self.graphs else "off"
        out: dict[str, str | int] = {**super().describe(), "graphs": graphs}
        out["compiles_during_traffic"], out["captures_during_traffic"] = self.during_traffic()
        return out

    def _capture_once(self, bucket: Bucket) -> _Captured:
        during = self.is_serving  # a step of traffic waits on it
        log.log(
            logging.WARNING if during else logging.DEBUG,
            "capturing a CUDA graph for %d sequences x %d tokens over %d blocks%s",
            bucket.seqs,
            bucket.query,
            bucket.blocks,
            " during traffic" if during else "",
        )
        graph, (hidden, features) = capture(
            lambda: self._static_forward(bucket), self.model.device, self._graph_pool
        )
        got = _Captured(graph, hidden, features)
        self._captured[bucket] = got
        return got
