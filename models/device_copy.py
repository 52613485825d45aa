"""Host values onto the device without waiting for it: ``torch.tensor(values, device=cuda)``
copies synchronously (torch synchronises the stream after the copy), so every such call stops
the host until the device has finished all the work queued before it. An asynchronous copy
from pageable memory is staged by the driver before the call returns: the source may go."""

from __future__ import annotations

from collections.abc import Sequence

import torch


def to_device(
    values: Sequence[int] | Sequence[float] | Sequence[bool],
    device: torch.device | str,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """[len(values)] on ``device``, queued behind the stream's work instead of waiting on it."""
    return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)
