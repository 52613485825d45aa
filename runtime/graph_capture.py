"""One CUDA graph captured over a forward that reads and writes persistent buffers."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:  # a private alias of torch's, absent from its runtime in some versions
    from torch.cuda import _POOL_HANDLE

Outputs = tuple[torch.Tensor, ...]


def capture(
    forward: Callable[[], Outputs], device: torch.device, pool: _POOL_HANDLE | None
) -> tuple[torch.cuda.CUDAGraph, Outputs]:
    """The graph of ``forward`` and its output buffers. The forward runs twice on a side stream
    first (lazy initialisation, kernel selection), then once under capture: those runs compute
    this very step, so their writes (K/V included) are the step's own."""
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(2):
            forward()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        out = forward()
    return graph, out
