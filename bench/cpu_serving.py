"""A model readied as a CPU replica serves it (``models.cpu.backend.CpuBackend``), for the
benchmarks that time its steps, and the same served model around another attention backend."""

from __future__ import annotations

import torch

from models.attention.backend import AttentionBackend
from models.cpu.backend import CpuBackend
from models.kv_layout import kv_pool_shape
from models.llama import LlamaModel
from runtime.backends import model_backend


def serve_on_cpu(model: LlamaModel, block_size: int) -> CpuBackend:
    """``model`` readied as ``runtime.shard`` serves it on a CPU (``runtime.backends
    .model_backend``: weights packed, the greedy screen, the layer program, the CPU attention
    kernel); load it with ``ops=CpuRowOps()`` for the row ops and the program. The kernel reads
    whatever pool a step is given, so the backend serves every pool of ``block_size``-token
    blocks (``runtime.runner.run_step(served, pool, batch)``)."""
    c = model.cfg
    shape = kv_pool_shape(1, model.num_kv_heads_local, c.num_layers, block_size, c.head_dim)
    served = model_backend(model, torch.zeros(shape, dtype=model.dtype), block_size)
    if not isinstance(served, CpuBackend):
        raise ValueError(f"a model on {model.device} is not served by the CPU backend")
    return served


def with_attention(served: CpuBackend, attention: AttentionBackend) -> CpuBackend:
    """``served`` (its packed weights, screen and layer program) around ``attention``: the
    program runs only the steps whose attention is the CPU kernel's, the modules the rest."""
    return CpuBackend(
        served.model, attention, served.packer, served.packed, served.screen, served.program
    )
