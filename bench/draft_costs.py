"""What drafting one token costs at batch 1, in the paged runners decode uses: the target's own
step, an independent draft LM's token and prompt prefill, and the shipped EAGLE head's token
(``bench.draft_kind`` compares the kinds with these)."""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Any

import torch

from models.eagle import load_eagle
from models.kv_layout import kv_pool_shape
from models.spec import ModelSpec
from runtime.runner import EagleRunner, LocalRunner, SeqInput

HEAD = Path(__file__).parent.parent / "models" / "drafts" / "smollm2-135m-eagle"


def _median_ms(fn: Any, repeats: int = 40) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1000 * statistics.median(times)


@torch.no_grad()
def costs(folder: Path, draft_folder: Path, context: int = 512) -> dict[str, float]:
    """ms per drafted token at batch 1 with ``context`` tokens cached: target, draft LM, head."""
    table = list(range(context // 16 + 2))
    out: dict[str, float] = {}
    for name, spec in (
        ("target_step_ms", ModelSpec(str(folder))),
        ("draft_lm_token_ms", ModelSpec(str(draft_folder))),
    ):
        model = spec.load()
        c = model.cfg
        pool = torch.zeros(kv_pool_shape(len(table), c.num_kv_heads, c.num_layers, 16, c.head_dim))
        step = LocalRunner(model, pool, 16)  # its modules, the attention chosen for the CPU
        step.run([SeqInput(table, 0, [5] * context, [])])
        out[name] = _median_ms(lambda r=step: r.run([SeqInput(table, context, [7], [0])]))
        if name == "draft_lm_token_ms":
            out["draft_lm_prompt_prefill_ms"] = _median_ms(
                lambda r=step: r.run([SeqInput(table, 0, [5] * context, [])]), 5
            )
    head = load_eagle(HEAD, folder, torch.float32, "cpu")
    c = head.cfg.layer
    pool = torch.zeros(kv_pool_shape(len(table), c.num_kv_heads, 1, 16, c.head_dim))
    runner = EagleRunner(head, pool, 16)
    feats = torch.zeros(context, c.hidden_size)
    runner.run([SeqInput(table, 0, [5] * context, [context - 1])], feats)
    out["eagle_head_token_ms"] = _median_ms(
        lambda: runner.run([SeqInput(table, context, [7], [0])], feats[:1])
    )
    return out
