"""What the device checks share: the model backend a GPU serves with (one flex kernel per
model), a memory-bandwidth probe, random bf16 models built on the device, and the 8B shape."""

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


# Llama-3.1-8B's config.json, the fields the model reads (weights random)
LLAMA_8B: dict[str, Any] = {
    "vocab_size": 128256,
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "rope_theta": 500000.0,
    "rope_scaling": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    },
    "rms_norm_eps": 1e-5,
    "max_position_embeddings": 131072,
    "tie_word_embeddings": False,
    "bos_token_id": 128000,
    "eos_token_id": [128001, 128008, 128009],
}
SMALL_8B = LLAMA_8B | {
    "vocab_size": 4096,
    "hidden_size": 512,
    "intermediate_size": 1024,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}
