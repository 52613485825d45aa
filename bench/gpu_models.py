"""What the device checks share: the model backend a GPU serves with (one flex kernel per
model), a memory-bandwidth probe, and random bf16 models built on the device."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import torch

from runtime.runner import synchronize

if TYPE_CHECKING:
    from models.attention.flex_kernel import FlexKernel
    from models.backend import ModelBackend


def served_backend(model: Any, pool: torch.Tensor, flex: FlexKernel) -> ModelBackend:
    """The model's own modules around the attention backend chosen for its device
    (``runtime.backends.attention_for``, what ``LocalRunner`` picks unless given one), with
    ``flex`` as the flex backend's kernel on a GPU: one kernel per model, whatever the pool, so
    its compiled shapes, ``failed`` and ``fallbacks`` are the model's."""
    from models.attention.flex import FlexBackend
    from models.backend import TorchBackend
    from runtime.backends import attention_for, exact_attention, model_attention_spec

    spec = model_attention_spec(model, pool, 16)
    attention = attention_for(spec, model.dtype, exact_attention(model))
    if isinstance(attention, FlexBackend):
        attention = FlexBackend(spec, flex)
    return TorchBackend(model, attention)


def memory_bandwidth(dev: str, nbytes: int = 2**30) -> float:
    """Bytes a second one ``copy_`` moves (read + write), best of 10."""
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=dev)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(10):
        synchronize(dev)
        t0 = time.perf_counter()
        dst.copy_(src)
        synchronize(dev)
        best = min(best, time.perf_counter() - t0)
    return 2 * nbytes / best


def random_model(hf: dict[str, Any], dev: str) -> Any:
    """A bf16 ``LlamaModel`` of config ``hf`` with random weights, built on ``dev``."""
    from models.config import LlamaConfig
    from models.llama import LlamaModel

    torch.manual_seed(0)
    model = LlamaModel(LlamaConfig.from_hf_dict(hf), dtype=torch.bfloat16, device=dev)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02)
    return model.eval()
