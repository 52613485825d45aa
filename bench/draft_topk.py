"""How often the target's greedy token is among an EAGLE head's top-k drafts, by depth.

Teacher-forced on the held-out feature cache of a ``tandem distill`` run (``--work-dir``): at
each held-out assistant position, depth ``d`` drafts from the head's own predicted features as
the drafter does, and we count whether the target's argmax is the head's first choice, or among
its first ``k``. Top-1 is greedy chain acceptance (what ``models/drafts/*/card.json`` reports
at temperature 0); top-k is the ceiling of a draft tree that tries ``k`` candidates at that
depth in one verifying forward, the lever for tokens per forward beyond a better head.

    .venv/bin/python -m bench.draft_topk --work-dir /work/distill_run/work6 \
        --out bench/results/draft_topk.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from distill.data import load_corpus
from distill.evaluate import held_out_drafts
from models.eagle import load_eagle
from models.embedded import embedded_eagle_path
from models.weights import load_state_dict, resolve_checkpoint


@torch.no_grad()
def topk_agreement(
    head_folder: Path, target: str, features: Path, depth: int, ks: tuple[int, ...]
) -> dict[str, object]:
    """Per depth, the share of held-out positions whose target argmax is in the head's top-k."""
    folder = resolve_checkpoint(target)
    head = load_eagle(head_folder, folder, torch.float32, "cpu")
    weights = load_state_dict(folder)
    lm = weights.get("lm_head.weight", weights["model.embed_tokens.weight"]).float()  # [V, H]
    hits = torch.zeros(depth, len(ks), dtype=torch.float64)
    counts = torch.zeros(depth, dtype=torch.float64)
    kmax = max(ks)
    for d, draft, target_logits in held_out_drafts(head, load_corpus(features), lm, depth):
        top = draft.topk(kmax, dim=-1).indices  # [n, kmax]
        match = top == target_logits.argmax(-1, keepdim=True)  # [n, kmax]
        counts[d] += draft.shape[0]
        for j, k in enumerate(ks):
            hits[d, j] += float(match[:, :k].any(-1).sum())
    share = hits / counts.clamp_min(1.0).unsqueeze(-1)
    return {
        "head": str(head_folder),
        "features": str(features),
        "positions": int(counts[0]),
        "topk_by_depth": {
            f"depth_{d + 1}": {f"top{k}": round(float(share[d, j]), 4) for j, k in enumerate(ks)}
            for d in range(depth)
        },
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--work-dir", type=Path, required=True, help="a tandem distill work dir")
    ap.add_argument("--head", type=Path, default=None, help="default: the shipped head")
    ap.add_argument("--target", default="embedded")
    ap.add_argument("--depth", type=int, default=4)
    ap.add_argument("--ks", type=int, nargs="+", default=[1, 2, 3, 4, 8])
    ap.add_argument("--out", type=Path, default=Path("bench/results/draft_topk.json"))
    args = ap.parse_args()
    report = topk_agreement(
        args.head or embedded_eagle_path(),
        args.target,
        args.work_dir / "features-eval",
        args.depth,
        tuple(args.ks),
    )
    print(json.dumps(report, indent=2))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
