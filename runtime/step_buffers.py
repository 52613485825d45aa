"""A bucketed step's inputs in one int64 host tensor, copied to the device in one transfer and
read through views at fixed addresses (so CUDA graphs replay over them). A bucket rounds each of
(seqs, query, blocks) up to a power of two; row ``i * query + j`` is sequence i's j-th token."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from models.attention.metadata import BucketInputs
from runtime.runner import SeqInput

ROW_FIELDS = ("ids", "positions", "slot_blocks", "slot_offsets", "write_rows", "logit_rows")


def bucket_size(n: int, cap: int) -> int:
    return min(1 << max(0, n - 1).bit_length(), cap)


def _sizes(cap: int) -> list[int]:
    """Every value ``bucket_size(n, cap)`` takes for n in 1..cap."""
    return sorted({bucket_size(n, cap) for n in range(1, cap + 1)})


@dataclass(frozen=True)
class Bucket:
    seqs: int
    query: int
    blocks: int


@dataclass(frozen=True)
class Filled:
    bucket: Bucket
    num_logits: int
    num_tokens: int
    rows_per_seq: tuple[int, ...]


@dataclass(frozen=True)
class BucketViews:
    """Device views of the buffers for one bucket (``b = seqs``, ``q = query``)."""

    ids: torch.Tensor  # [b * q] token ids (padding: 0)
    positions: torch.Tensor
    slot_blocks: torch.Tensor
    slot_offsets: torch.Tensor
    write_rows: torch.Tensor  # [b * q] the row whose K/V each row writes (itself, or row 0)
    tables: torch.Tensor  # [b, blocks] (padding: block 0)
    cached: torch.Tensor  # [b] tokens before the new ones
    num_new: torch.Tensor  # [b] new tokens (padding sequences: 0)


class StepBuffers:
    def __init__(
        self, max_seqs: int, max_query: int, max_blocks: int, block_size: int, device: torch.device
    ) -> None:
        self.max_seqs, self.max_query, self.max_blocks = max_seqs, max_query, max_blocks
        self.block_size = block_size
        rows = max_seqs * max_query
        sizes = [rows] * len(ROW_FIELDS) + [rows, max_seqs * max_blocks, max_seqs, max_seqs]
        names = [*ROW_FIELDS, "token_rows", "tables", "cached", "num_new"]
        self._at: dict[str, tuple[int, int]] = {}
        start = 0
        for name, n in zip(names, sizes, strict=True):
            self._at[name] = (start, n)
            start += n
        on_cpu = device.type == "cpu"
        # a GPU stages in two pinned buffers by turns: with overlapped scheduling the next
        # step's inputs are written while this step's asynchronous copy may not have run yet
        self._stages = [
            torch.zeros(start, dtype=torch.long, pin_memory=not on_cpu)
            for _ in range(1 if on_cpu else 2)
        ]
        self._copied: list[torch.cuda.Event | None] = [None] * len(self._stages)
        self._turn = 0
        self.device = (
            self._stages[0] if on_cpu else torch.zeros(start, dtype=torch.long, device=device)
        )
        self._np = self._stages[0].numpy()

    def _host(self, name: str) -> np.ndarray:
        s, n = self._at[name]
        out: np.ndarray = self._np[s : s + n]
        return out

    def _next_stage(self) -> torch.Tensor:
        """The staging buffer to write now, once the copy that last read it has run."""
        self._turn = (self._turn + 1) % len(self._stages)
        copied = self._copied[self._turn]
        if copied is not None:
            copied.synchronize()
        stage = self._stages[self._turn]
        self._np = stage.numpy()
        return stage

    def _dev(self, name: str, n: int) -> torch.Tensor:
        s, _ = self._at[name]
        return self.device[s : s + n]

    def fits(self, batch: Sequence[SeqInput]) -> bool:
        """Decodes and chain verifications (no trees, no first chunks) within the sizes."""
        if not batch or len(batch) > self.max_seqs:
            return False
        for s in batch:
            blocks = -(-(s.num_cached + len(s.token_ids)) // self.block_size)
            if (
                s.tree is not None
                or s.num_cached == 0
                or not 0 < len(s.token_ids) <= self.max_query
                or blocks > self.max_blocks
                or len(s.block_table) < blocks
            ):
                return False
        return True

    def grid(self) -> list[Bucket]:
        """Every bucket a step can land in: one whose smallest query (one past the size below)
        fits in its blocks beside a cached token."""
        queries = _sizes(self.max_query)
        smallest = dict(zip(queries, [1] + [q + 1 for q in queries[:-1]], strict=True))
        return [
            Bucket(b, q, nb)
            for b in _sizes(self.max_seqs)
            for q in queries
            for nb in _sizes(self.max_blocks)
            if smallest[q] < nb * self.block_size
        ]

    def fill(self, batch: Sequence[SeqInput]) -> Filled:
        bs = self.block_size
        b = bucket_size(len(batch), self.max_seqs)
        q = bucket_size(max(len(s.token_ids) for s in batch), self.max_query)
        need = [-(-(s.num_cached + len(s.token_ids)) // bs) for s in batch]
        nb = bucket_size(max(need), self.max_blocks)
        rows = b * q
        stage = self._next_stage()
        h = {name: self._host(name) for name in self._at}
        for name in (*ROW_FIELDS, "token_rows"):
            h[name][:rows] = 0
        h["cached"][:b] = 0
        h["num_new"][:b] = 0
        tables = h["tables"][: b * nb].reshape(b, nb)
        tables[:] = 0
        logits = tokens = 0
        for i, s in enumerate(batch):
            n = len(s.token_ids)
            r = i * q
            slots = np.arange(s.num_cached, s.num_cached + n)
            h["ids"][r : r + n] = s.token_ids
            h["positions"][r : r + n] = slots
            table = np.asarray(s.block_table[: need[i]])
            h["slot_blocks"][r : r + n] = table[slots // bs]
            h["slot_offsets"][r : r + n] = slots % bs
            h["write_rows"][r : r + n] = np.arange(r, r + n)
            h["cached"][i], h["num_new"][i] = s.num_cached, n
            tables[i, : need[i]] = table
            h["token_rows"][tokens : tokens + n] = np.arange(r, r + n)
            tokens += n
            lp = len(s.logit_positions)
            h["logit_rows"][logits : logits + lp] = r + np.asarray(
                s.logit_positions, dtype=np.int64
            )
            logits += lp
        # padding rows repeat row 0's write: the same bytes to the same slot
        pad = h["write_rows"][:rows] == 0
        pad[0] = False
        h["slot_blocks"][:rows][pad] = h["slot_blocks"][0]
        h["slot_offsets"][:rows][pad] = h["slot_offsets"][0]
        h["positions"][:rows][pad] = h["positions"][0]
        if self.device is not stage:
            self.device.copy_(stage, non_blocking=True)
            copied = self._copied[self._turn] = torch.cuda.Event()
            copied.record()
        return Filled(
            Bucket(b, q, nb), logits, tokens, tuple(len(s.logit_positions) for s in batch)
        )

    def views(self, bucket: Bucket) -> BucketViews:
        b, q, nb = bucket.seqs, bucket.query, bucket.blocks
        rows = b * q
        tables = self._dev("tables", b * nb).view(b, nb)
        return BucketViews(
            ids=self._dev("ids", rows),
            positions=self._dev("positions", rows),
            slot_blocks=self._dev("slot_blocks", rows),
            slot_offsets=self._dev("slot_offsets", rows),
            write_rows=self._dev("write_rows", rows),
            tables=tables,
            cached=self._dev("cached", b),
            num_new=self._dev("num_new", b),
        )

    def bucket_inputs(self, bucket: Bucket) -> BucketInputs:
        """What the attention plans a bucketed step from: the buffers' device views."""
        v = self.views(bucket)
        return BucketInputs(
            positions=v.positions,
            slot_blocks=v.slot_blocks,
            slot_offsets=v.slot_offsets,
            write_rows=v.write_rows,
            tables=v.tables,
            cached=v.cached,
            num_new=v.num_new,
        )

    def put_ids(self, filled: Filled, ids: torch.Tensor) -> None:
        """ids: [T] the step's tokens on the device, in batch order, over the copied ones."""
        b = filled.bucket
        self._dev("ids", b.seqs * b.query).index_copy_(0, self.token_rows(filled), ids)

    def logit_rows(self, filled: Filled) -> torch.Tensor:
        """[N] the bucket rows whose logits the step asked for, in batch order."""
        return self._dev("logit_rows", filled.num_logits)

    def token_rows(self, filled: Filled) -> torch.Tensor:
        """[T] the bucket row of every new token, in batch order."""
        return self._dev("token_rows", filled.num_tokens)
