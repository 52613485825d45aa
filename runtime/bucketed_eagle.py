"""An EAGLE head's chain steps at the target's buckets: its catch-up over the target's features
and each round over its own, one CUDA graph per bucket and feature source on a GPU; tree levels
and steps that fit no bucket run ragged."""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from models.attention.backend import AttentionBackend
from models.eagle import EagleHead
from runtime.graph_capture import capture
from runtime.runner import EagleRunner, SeqInput, StepResult
from runtime.step_buffers import Bucket, StepBuffers
from runtime.traffic_waits import TrafficWaits
from runtime.warm_up import warm_batch

log = logging.getLogger(__name__)


class BucketedEagleRunner(EagleRunner, TrafficWaits):
    def __init__(
        self,
        head: EagleHead,
        kv_pool: torch.Tensor,
        block_size: int,
        max_seqs: int,
        max_query: int,
        max_blocks: int,
        graphs: bool = False,
        attention: AttentionBackend | None = None,
    ) -> None:
        super().__init__(head, kv_pool, block_size, attention)
        self.buffers = StepBuffers(max_seqs, max_query, max_blocks, block_size, head.device)
        rows = max_seqs * max_query
        widths = {True: head.cfg.feature_width, False: head.cfg.layer.hidden_size}
        # [rows, F] each row's input features: the target's (catch-up) or the head's (rounds)
        self._features = {
            source: torch.zeros(rows, w, dtype=head.dtype, device=head.device)
            for source, w in widths.items()
        }
        self.graphs = graphs and head.device.type == "cuda"
        self._captured: dict[tuple[Bucket, bool], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._graph_pool = torch.cuda.graph_pool_handle() if self.graphs else None
        self.bucketed_steps = 0
        self.ragged_steps = 0

    @property
    def compiles(self) -> int:
        return self.attention.compiles

    @property
    def captures(self) -> int:
        return len(self._captured)

    def describe(self) -> dict[str, str | int]:
        graphs = f"{len(self._captured)} buckets captured" if self.graphs else "off"
        return {"attention": self.attention.describe(), "graphs": graphs}

    def warm(self, bucket: Bucket) -> None:
        """Step ``bucket`` from both feature sources (they are different graphs)."""
        batch = warm_batch(bucket, self.block_size)
        tokens = sum(len(s.token_ids) for s in batch)
        for source, buffer in self._features.items():
            self.run(batch, buffer.new_zeros(tokens, buffer.shape[1]), source)

    @torch.inference_mode()
    def run(
        self,
        batch: Sequence[SeqInput],
        features: torch.Tensor,
        from_target: bool = True,
        ids: torch.Tensor | None = None,
    ) -> StepResult:
        if not self.buffers.fits(batch):
            self.ragged_steps += 1
            return super().run(batch, features, from_target, ids)
        self.bucketed_steps += 1
        filled = self.buffers.fill(batch)
        if ids is not None:
            self.buffers.put_ids(filled, ids)
        rows = self.buffers.token_rows(filled)  # [T]
        buffer = self._features[from_target]
        buffer.index_copy_(0, rows, features.to(buffer.device, buffer.dtype))
        hidden = self._forward(filled.bucket, from_target)  # [b * q, H]
        picked = hidden[self.buffers.logit_rows(filled)]  # [N, H]
        return StepResult(
            hidden=picked,
            logits=self.head.logits(picked),
            rows_per_seq=filled.rows_per_seq,
            all_hidden=hidden[rows],
        )

    def _forward(self, bucket: Bucket, from_target: bool) -> torch.Tensor:
        if not self.graphs:
            return self._static_forward(bucket, from_target)
        got = self._captured.get((bucket, from_target))
        if got is None:
            log.log(
                logging.WARNING if self.is_serving else logging.DEBUG,
                "capturing an EAGLE head graph for %s (target features: %s)",
                bucket,
                from_target,
            )
            graph, (hidden,) = capture(
                lambda: (self._static_forward(bucket, from_target),),
                self.head.device,
                self._graph_pool,
            )
            got = self._captured[(bucket, from_target)] = (graph, hidden)
        got[0].replay()
        return got[1]

    def _static_forward(self, bucket: Bucket, from_target: bool) -> torch.Tensor:
        meta = self.attention.plan_bucket(self.buffers.bucket_inputs(bucket))
        rows = bucket.seqs * bucket.query
        features = self._features[from_target][:rows]
        hidden: torch.Tensor = self.head(
            self.buffers.views(bucket).ids, features, self.kv_pool, meta, from_target
        )
        return hidden
