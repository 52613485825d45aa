"""TP=2 gives TP=1's logits (fp32, 1e-5): two ranks as threads over a gloo group, no Ray."""

from __future__ import annotations

import threading
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import TypeVar

import torch
import torch.distributed as dist

from models.kv_layout import kv_pool_shape
from models.parallel import TPContext
from models.spec import ModelSpec
from runtime.ports import free_port
from runtime.runner import LocalRunner, SeqInput, StepResult

BS = 16
T = TypeVar("T")


def _batches(vocab: int) -> list[list[SeqInput]]:
    g = torch.Generator().manual_seed(0)
    a = torch.randint(3, vocab, (40,), generator=g).tolist()
    b = torch.randint(3, vocab, (23,), generator=g).tolist()
    prompt = [SeqInput([0, 1, 2], 0, a[:35], [34]), SeqInput([3, 4], 0, b[:20], [19])]
    verify = [
        SeqInput([0, 1, 2], 35, a[35:40], list(range(5))),
        SeqInput([3, 4], 20, b[20:21], [0]),
    ]
    return [prompt, verify]


def _run(spec: ModelSpec, tp: TPContext, out: list[StepResult]) -> None:
    model = spec.load(tp=tp)
    c = model.cfg
    pool = torch.zeros(
        kv_pool_shape(8, c.num_kv_heads // tp.world_size, c.num_layers, BS, c.head_dim)
    )
    for batch in _batches(c.vocab_size):
        out.append(LocalRunner(model, pool, BS).run(batch))


def on_two_ranks(work: Callable[[TPContext], T]) -> list[T]:
    """``work`` on ranks 0 and 1 of a TP = 2 group (two threads over gloo), in rank order."""
    port = free_port()
    results: dict[int, T] = {}
    errors: list[BaseException] = []

    def rank(r: int) -> None:
        try:
            store = dist.TCPStore("127.0.0.1", port, 2, is_master=r == 0, use_libuv=False)  # type: ignore[attr-defined]
            group = dist.ProcessGroupGloo(store, r, 2, timedelta(seconds=60))
            results[r] = work(TPContext(r, 2, group))
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=rank, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors
    return [results[0], results[1]]


def check_tp2_matches_tp1(spec: ModelSpec, tol: float = 1e-5) -> None:
    """TP=2 gives TP=1's logits (to ``tol``) for a prompt step and a verification step, and
    both ranks gather the same full-vocabulary logits."""
    single: list[StepResult] = []
    _run(spec, TPContext(), single)

    def steps(tp: TPContext) -> list[StepResult]:
        out: list[StepResult] = []
        _run(spec, tp, out)
        return out

    r0s, r1s = on_two_ranks(steps)
    for tp1, r0, r1 in zip(single, r0s, r1s, strict=True):
        assert (tp1.logits - r0.logits).abs().max().item() <= tol
        assert torch.equal(r0.logits, r1.logits)  # every rank gathers the full vocabulary


def test_tp2_logits_match_tp1(tiny_folder: Path) -> None:
    check_tp2_matches_tp1(ModelSpec(str(tiny_folder)))
