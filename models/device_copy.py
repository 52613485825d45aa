"""Host values onto the device without waiting for it: ``torch.tensor(values, device=cuda)``
copies synchronously (torch synchronises the stream after the copy), so every such call stops
the host until the device has finished all the work queued before it. An asynchronous copy
from pageable memory is staged by the driver before the call returns: the source may go."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch


def to_device(
    values: Sequence[int] | Sequence[float] | Sequence[bool],
    device: torch.device | str,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """[len(values)] on ``device``, queued behind the stream's work instead of waiting on it."""
    return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)


class HostCopy:
    """A device tensor's values on their way to the host: the copy is queued behind the work
    that makes them, so reading them later waits for that work only, not for what was queued
    after it (the next step, launched before this one is read)."""

    def __init__(self, values: torch.Tensor) -> None:
        self._done: torch.cuda.Event | None = None
        if values.device.type != "cuda":
            self._host = values
            return
        self._host = torch.empty(values.shape, dtype=values.dtype, pin_memory=True)
        self._host.copy_(values, non_blocking=True)
        self._done = torch.cuda.Event()
        self._done.record()

    def tolist(self) -> list[Any]:
        """The values (waiting for their copy on a GPU)."""
        if self._done is not None:
            self._done.synchronize()
        return self._host.tolist()
