"""Runs the logits processors over a step's rows: each row with the request's emitted tokens and
the drafts before its position, grammar masks included (see models/logits_processing.py)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from models.device_copy import to_device
from models.logits_processing import ProcessRow, process_logits
from models.request import Request


@dataclass(frozen=True)
class Span:
    """Rows ``row, row + 1, ...`` of one request score the positions after ``ahead[:start]``,
    ``ahead[:start + 1]``, ... ``ahead`` (drafts after its emitted tokens)."""

    req: Request
    row: int
    ahead: tuple[int, ...]
    start: int = 0


def process_spans(logits: torch.Tensor, spans: Sequence[Span]) -> torch.Tensor:
    """logits: [N, V] -> [N, V]: the processed rows replaced, where a request processes."""
    rows: list[ProcessRow] = []
    index: list[int] = []
    for s in spans:
        sp = s.req.sampling
        if not sp.processes:
            continue
        out = s.req.output_token_ids
        g = s.req.grammar
        if sp.grammar is not None and g is None:
            raise RuntimeError(f"request {s.req.request_id} has a grammar but no grammar state")
        masks = g.masks(out, s.ahead)[s.start :] if g is not None else None
        for j in range(len(s.ahead) - s.start + 1):
            before = [*out, *s.ahead[: s.start + j]]
            allowed = masks[j] if masks is not None else None
            rows.append(ProcessRow(sp, s.req.prompt_token_ids, before, allowed))
            index.append(s.row + j)
    if not rows:
        return logits
    at = to_device(index, logits.device)
    out_logits = logits.float().clone()
    out_logits[at] = process_logits(logits[at], rows)
    return out_logits
