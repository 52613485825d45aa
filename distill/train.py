"""The training loop of ``tandem distill``: seeded init and data order, AdamW with warmup and
cosine decay, and checkpoints from which a resumed run continues exactly as an unbroken one."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch

from distill.data import Corpus, check_streams
from distill.objective import LossParts, LossWeights, distill_loss, trainable_parameters
from distill.objective import unrolled_forward as head_forward
from models.config import LlamaConfig
from models.eagle import EagleConfig, EagleHead, default_aux_layers
from models.layers import RMSNorm


@dataclass(frozen=True)
class TrainConfig:
    steps: int = 2000
    batch_tokens: int = 4096  # padded tokens per step
    lr: float = 1e-3
    warmup: int = 100
    min_lr_ratio: float = 0.1
    depth: int = 2  # drafting depths unrolled in training (1 = plain EAGLE)
    weights: LossWeights = field(default_factory=LossWeights)
    grad_clip: float = 0.5
    seed: int = 0
    checkpoint_every: int = 100
    bf16: bool = True
    eagle3: bool = False


# EAGLE-3 trains only the token distribution: its g lives in the head's own space.
EAGLE3_WEIGHTS = LossWeights(regression=0.0, distribution=1.0)


def make_head(
    target_cfg: LlamaConfig,
    target_embed: torch.Tensor,
    target_lm: torch.Tensor,
    draft_ids: torch.Tensor,
    seed: int,
    device: str,
    eagle3: bool = False,
    target_norm: torch.Tensor | None = None,
) -> EagleHead:
    """A fresh head: the target's embeddings and draft-vocabulary LM rows, other weights
    N(0, 0.02) from ``seed``; ``fc`` passes the feature (EAGLE-3: the top stream, target's norm)."""
    vd = int(draft_ids.shape[0])
    h = target_cfg.hidden_size
    cfg = EagleConfig(
        layer=replace(target_cfg, num_layers=1),
        vocab_size=target_cfg.vocab_size,
        draft_vocab_size=vd,
        fc_bias=not eagle3,
        final_norm=eagle3,
        eagle3=eagle3,
        aux_layers=default_aux_layers(target_cfg.num_layers) if eagle3 else None,
        target_hidden_size=h,
    )
    head = EagleHead(cfg, torch.float32, device)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in head.named_parameters():
            if p.dim() == 2 and not name.startswith(("embed_tokens", "lm_head")):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.02)
        eye = torch.eye(h, device=head.fc.weight.device)
        if eagle3:
            head.fc.weight[:, 2 * h :] += eye  # [H, 3H]: the high stream through
            if target_norm is not None:
                assert isinstance(head.norm, RMSNorm)
                head.norm.weight.copy_(target_norm)
        else:
            assert head.fc.bias is not None
            head.fc.bias.zero_()
            head.fc.weight[:, h:] += eye  # [H, 2H]: the feature through, not the embedding
        head.embed_tokens.weight.copy_(target_embed)
        head.lm_head.weight.copy_(target_lm[draft_ids])
        head.d2t.copy_(draft_ids - torch.arange(vd))
    return head


def epoch_batches(lengths: list[int], batch_tokens: int, seed: int, epoch: int) -> list[list[int]]:
    """The rows of each step of one epoch, shuffled and length-grouped in windows of 64."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    order = torch.randperm(len(lengths), generator=g).tolist()
    batches: list[list[int]] = []
    for w in range(0, len(order), 64):
        cur: list[int] = []
        for r in sorted(order[w : w + 64], key=lambda r: lengths[r]):
            if cur and (len(cur) + 1) * lengths[r] > batch_tokens:
                batches.append(cur)
                cur = []
            cur.append(r)
        batches.append(cur)
    return [batches[i] for i in torch.randperm(len(batches), generator=g).tolist()]


def batch_at(lengths: list[int], cfg: TrainConfig, step: int) -> list[int]:
    epoch = 0
    while True:
        batches = epoch_batches(lengths, cfg.batch_tokens, cfg.seed, epoch)
        if step < len(batches):
            return batches[step]
        step -= len(batches)
        epoch += 1


@dataclass(frozen=True)
class Batch:
    ids: torch.Tensor
    feats: torch.Tensor  # [B, T, F] what the head reads at s (f_s, or EAGLE-3's streams)
    next_feats: torch.Tensor  # [B, T, H] f_{s+1}, the target's final hidden state (labels)
    mask: torch.Tensor


def make_batch(corpus: Corpus, rows: list[int], device: str, eagle3: bool = False) -> Batch:
    t = max(int(corpus.offsets[r + 1] - corpus.offsets[r]) for r in rows) - 1
    h = corpus.feats.shape[1]
    width = corpus.inputs(rows[0], eagle3).shape[1]
    ids = torch.zeros(len(rows), t, dtype=torch.long)
    feats = torch.zeros(len(rows), t + 1, h)
    inputs = torch.zeros(len(rows), t, width)
    mask = torch.zeros(len(rows), t)
    for i, r in enumerate(rows):
        f, x, _ = corpus.row(r)
        n = x.shape[0] - 1
        ids[i, :n] = x[1:]
        feats[i, : n + 1] = f.float()
        inputs[i, :n] = corpus.inputs(r, eagle3)[:n].float()
        mask[i, :n] = 1.0
    return Batch(ids.to(device), inputs.to(device), feats[:, 1:].to(device), mask.to(device))


def lr_at(cfg: TrainConfig, step: int) -> float:
    warm = min(1.0, (step + 1) / max(cfg.warmup, 1))
    progress = min(1.0, step / max(cfg.steps - 1, 1))
    cosine = cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
    return cfg.lr * warm * cosine


@dataclass(frozen=True)
class StepLog:
    step: int
    loss: float
    kl: tuple[float, ...]
    top1: tuple[float, ...]


@dataclass(frozen=True)
class TrainState:
    step: int
    seconds: float
    history: tuple[StepLog, ...]


def train(
    head: EagleHead,
    corpus: Corpus,
    target_rows: torch.Tensor,
    cfg: TrainConfig,
    checkpoint: Path,
    until: int | None = None,
    on_step: Callable[[StepLog], None] = lambda _: None,
) -> TrainState:
    """Train ``head`` in place up to ``until`` (default ``cfg.steps``), resuming from and saving
    ``checkpoint``. target_rows: [V_draft, H] the target's LM-head rows of the draft vocabulary."""
    check_streams(head, corpus)
    params = trainable_parameters(head)
    named = {n: p for n, p in head.named_parameters() if p.requires_grad}
    opt = torch.optim.AdamW(params, lr=cfg.lr, betas=(0.9, 0.95), weight_decay=0.0)
    state = TrainState(0, 0.0, ())
    if checkpoint.exists():
        state = _restore(checkpoint, cfg, named, opt)
    lengths = [int(corpus.offsets[r + 1] - corpus.offsets[r]) for r in range(corpus.num_rows)]
    device = str(head.device)
    rows_v = target_rows.to(device)
    stop = cfg.steps if until is None else min(until, cfg.steps)
    history = list(state.history)
    seconds = state.seconds
    head.train()
    for step in range(state.step, stop):
        t0 = time.perf_counter()
        b = make_batch(corpus, batch_at(lengths, cfg, step), device, cfg.eagle3)
        with torch.autocast(head.device.type, torch.bfloat16, enabled=cfg.bf16):
            outs = head_forward(head, b.ids, b.feats, cfg.depth)
            parts: LossParts = distill_loss(head, outs, b.next_feats, rows_v, b.mask, cfg.weights)
        opt.zero_grad(set_to_none=True)
        parts.total.backward()
        torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
        for group in opt.param_groups:
            group["lr"] = lr_at(cfg, step)
        opt.step()
        seconds += time.perf_counter() - t0
        log = StepLog(step + 1, float(parts.total.detach()), parts.kl, parts.top1)
        history.append(log)
        on_step(log)
        done = step + 1
        if done % cfg.checkpoint_every == 0 or done == stop:
            _save(checkpoint, cfg, named, opt, TrainState(done, seconds, tuple(history)))
    head.eval()
    return TrainState(max(stop, state.step), seconds, tuple(history))


def _save(
    path: Path,
    cfg: TrainConfig,
    named: dict[str, torch.nn.Parameter],
    opt: torch.optim.Optimizer,
    state: TrainState,
) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    torch.save(
        {
            "config": asdict(cfg),
            "params": {n: p.detach().cpu() for n, p in named.items()},
            "optimizer": opt.state_dict(),
            "step": state.step,
            "seconds": state.seconds,
            "history": [asdict(h) for h in state.history],
        },
        tmp,
    )
    tmp.rename(path)  # a reader never sees half a checkpoint


def _restore(
    path: Path, cfg: TrainConfig, named: dict[str, torch.nn.Parameter], opt: torch.optim.Optimizer
) -> TrainState:
    ck = torch.load(path, map_location="cpu", weights_only=False)
    if ck["config"] != asdict(cfg):
        raise ValueError(
            f"{path} was written with other training settings ({ck['config']}); resume with the "
            "same settings or use another --work-dir"
        )
    with torch.no_grad():
        for n, p in named.items():
            p.copy_(ck["params"][n])
    opt.load_state_dict(ck["optimizer"])
    history = tuple(
        StepLog(h["step"], h["loss"], tuple(h["kl"]), tuple(h["top1"])) for h in ck["history"]
    )
    return TrainState(int(ck["step"]), float(ck["seconds"]), history)
