"""Shared test helpers: tiny random checkpoints and small utilities (no downloads)."""

from __future__ import annotations

import asyncio
import inspect
import shutil
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

import torch

if TYPE_CHECKING:
    from models.backend import ModelBackend
    from models.cpu.backend import CpuBackend
    from models.llama import LlamaModel

T = TypeVar("T")


def cpu_has_bf16_dot() -> bool:
    """Whether the panel kernel runs bf16 here (the CPU's AVX-512 BF16): bf16 models take
    its kernels and fp32 LM heads get a bf16 greedy screen only then."""
    from models.cpu.linear import CpuLinear

    return CpuLinear().kind_for(torch.bfloat16) is not None


def cpu_panel_serves() -> bool:
    """Whether a replica's matmuls take the panel kernel here (it needs AVX-512F; elsewhere
    oneDNN serves them, and the layer program, which needs the kernel, stands down)."""
    from models.cpu.linear import CpuPacker, PanelUse

    return CpuPacker(use=PanelUse.AUTO).panel()


def wait_until(
    check: Callable[[], T],
    timeout_s: float,
    what: str,
    interval_s: float = 0.1,
    ignoring: tuple[type[Exception], ...] = (),
) -> T:
    """Call ``check`` every ``interval_s`` until it returns a truthy value, and return that value.

    A check may also assert: an AssertionError (or one of ``ignoring``) counts as not yet.
    Past ``timeout_s``, an AssertionError names ``what`` and the last failure, chained."""
    deadline = time.monotonic() + timeout_s
    retry: tuple[type[Exception], ...] = (AssertionError, *ignoring)
    while True:
        last: Exception | None = None
        try:
            if got := check():
                return got
        except retry as e:
            last = e
        if time.monotonic() > deadline:
            detail = f": {last}" if last is not None else ""
            raise AssertionError(f"not within {timeout_s:g} s: {what}{detail}") from last
        time.sleep(interval_s)  # the poll's own pace, not synchronisation


async def wait_until_async(
    check: Callable[[], Awaitable[T] | T],
    timeout_s: float,
    what: str,
    interval_s: float = 0.05,
    ignoring: tuple[type[Exception], ...] = (),
) -> T:
    """``wait_until`` inside an event loop: ``check`` may be a coroutine function, and the loop
    runs other tasks between polls."""
    deadline = time.monotonic() + timeout_s
    retry: tuple[type[Exception], ...] = (AssertionError, *ignoring)
    while True:
        last: Exception | None = None
        try:
            got = check()
            if inspect.isawaitable(got):
                got = await got
            if got:
                return got
        except retry as e:
            last = e
        if time.monotonic() > deadline:
            detail = f": {last}" if last is not None else ""
            raise AssertionError(f"not within {timeout_s:g} s: {what}{detail}") from last
        await asyncio.sleep(interval_s)  # the poll's own pace, not synchronisation


def make_tiny_checkpoint(
    folder: Path,
    tokenizer_from: Path,
    seed: int,
    num_layers: int = 2,
    hidden: int = 64,
    heads: int = 4,
    kv_heads: int = 2,
    vocab_size: int | None = None,
    tie: bool = True,
    intermediate: int | None = None,
) -> Path:
    """A randomly initialised Llama of the embedded model's family, with its tokenizer files
    (``intermediate``: the MLP's width, twice ``hidden`` unless given)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    tok_cfg = LlamaConfig.from_pretrained(tokenizer_from)
    cfg = LlamaConfig(
        vocab_size=vocab_size or tok_cfg.vocab_size,
        hidden_size=hidden,
        intermediate_size=intermediate or hidden * 2,
        num_hidden_layers=num_layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=hidden // heads,
        max_position_embeddings=2048,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=tie,
        bos_token_id=tok_cfg.bos_token_id,
        eos_token_id=tok_cfg.eos_token_id,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():
        for p in model.parameters():  # larger weights: sharper, more varied distributions
            if p.dim() == 2:
                p.normal_(0.0, 0.08)
    model.save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        src = tokenizer_from / name
        if src.exists():
            shutil.copy(src, folder / name)
    return folder


def serve_on_cpu(model: LlamaModel, blocks: int = 8, block_size: int = 16) -> CpuBackend:
    """``model`` readied as a CPU replica with AVX-512 serves it (``CpuBackend.apply``, the panel
    kernel even on a CPU where a replica would take oneDNN), for pools of ``blocks``; load it
    with ``ops=CpuRowOps()`` for the row ops and the layer program."""
    from models.cpu.backend import CpuBackend
    from models.cpu.linear import PanelUse
    from models.kv_layout import kv_pool_shape
    from runtime.backends import model_backend

    c = model.cfg
    shape = kv_pool_shape(blocks, model.num_kv_heads_local, c.num_layers, block_size, c.head_dim)
    pool = torch.zeros(shape, dtype=model.dtype)
    served = model_backend(model, pool, block_size, panel=PanelUse.ALWAYS)
    assert isinstance(served, CpuBackend)
    return served


def assert_verification_equals_decodes(
    model: LlamaModel, n: int, k: int, blocks: int, backend: ModelBackend | None = None
) -> None:
    """Verifying ``k`` tokens after an ``n``-token prompt gives each row the logits a one-token
    decode gives it, bit for bit: what keeps greedy speculation token-identical to plain
    decoding. ``blocks`` of 16 tokens must hold ``n + k``; ``backend``: how the model runs
    (its modules unless given)."""
    from models.kv_layout import kv_pool_shape
    from runtime.runner import LocalRunner, SeqInput

    bs, c = 16, model.cfg
    g = torch.Generator().manual_seed(3)
    prompt = torch.randint(3, c.vocab_size, (n,), generator=g).tolist()
    tokens = torch.randint(3, c.vocab_size, (k,), generator=g).tolist()
    table = list(range(blocks))

    def fresh() -> LocalRunner:
        shape = kv_pool_shape(blocks, c.num_kv_heads, c.num_layers, bs, c.head_dim)
        runner = LocalRunner(model, torch.zeros(shape, dtype=model.dtype), bs, backend)
        runner.run([SeqInput(table, 0, prompt, [n - 1])])
        return runner

    runner = fresh()
    one_by_one = [
        runner.run([SeqInput(table, n + i, [t], [0])]).logits[0] for i, t in enumerate(tokens)
    ]
    verified = fresh().run([SeqInput(table, n, tokens, list(range(k)))]).logits
    for i in range(k):
        assert torch.equal(verified[i], one_by_one[i]), f"row {i} of {k}"
