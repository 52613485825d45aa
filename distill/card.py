"""The model card of a distilled draft: ``card.json`` (what was trained on what, and how well it
drafts on held-out data) and a ``README.md`` rendered from it."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from distill.evaluate import Acceptance

KS = (1, 2, 3, 4, 5)


def acceptance_json(acc: Acceptance) -> dict[str, Any]:
    return {
        "temperature": acc.temperature,
        "positions": acc.positions,
        "acceptance_per_depth": [round(a, 4) for a in acc.per_depth],
        "expected_tokens_per_forward": {
            f"k={k}": round(acc.expected_tokens(k), 3) for k in KS if k <= len(acc.per_depth)
        },
        "chain_tokens_per_forward": {
            f"k={k}": round(acc.chain_tokens(k), 3) for k in KS if k <= len(acc.per_depth)
        },
    }


def render_readme(card: dict[str, Any]) -> str:
    t, d, tr, v = card["target"], card["data"], card["training"], card["draft_vocab"]
    lines = [
        f"# {card['name']}: a distilled EAGLE draft of {t['name']}",
        "",
        f"An EAGLE-style head (`models/eagle.py`) for **{t['name']}** ({t['source']}), made by "
        "`tandem distill` from ShareGPT conversations teacher-forced through the target: the "
        "target's final hidden states are its inputs and the target's own distributions its "
        "labels. It loads with `models.eagle.load_eagle(folder, target_folder, dtype, device)`; "
        "the token embeddings come from the target.",
        "",
        "## Numbers",
        "",
        f"- Weights: `model.safetensors`, {card['weights']['dtype']}, "
        f"{card['weights']['bytes'] / 1e6:.1f} MB ({card['weights']['parameters']:,} parameters); "
        f"draft vocabulary {v['size']} of {t['vocab_size']} tokens (frequency-ranked on the "
        f"training transcripts; it holds {100 * v['heldout_generated_coverage']:.1f}% of the "
        "held-out assistant tokens).",
        f"- Data: `{d['dataset']}`; {d['train']['conversations']} training conversations "
        f"({d['train']['tokens']:,} tokens{shortfall(d['train'])}), {d['eval']['conversations']} "
        f"held-out ({d['eval']['tokens']:,} tokens{shortfall(d['eval'])}); {d['split']}",
        f"- Training: {tr['steps']} steps of ~{tr['batch_tokens']} tokens, depth {tr['depth']} "
        f"unrolled, seed {tr['seed']}, {tr['device']} ({tr['threads']} threads); feature "
        f"extraction {tr['extraction_seconds'] / 60:.1f} min, training "
        f"{tr['train_seconds'] / 60:.1f} min, end to end {tr['total_seconds'] / 60:.1f} min.",
        "",
        "Held-out teacher-forced acceptance (assistant tokens of held-out conversations; depth d "
        "= the d-th draft token of a chain, drafted from the head's own predicted features):",
        "",
        "| temperature | acceptance by depth 1..5 | E[tokens/forward], k=4: "
        "a_1 for every depth | from per-depth rates |",
        "|---|---|---|---|",
    ]
    for a in card["held_out_acceptance"]:
        per = ", ".join(f"{x:.3f}" for x in a["acceptance_per_depth"])
        lines.append(
            f"| {a['temperature']} | {per} | {a['expected_tokens_per_forward'].get('k=4', '-')} "
            f"| {a['chain_tokens_per_forward'].get('k=4', '-')} |"
        )
    lines += [
        "",
        "E[tokens/forward] counts the bonus token; `speculation.goodput.expected_tokens(a_1, k)` "
        "assumes every depth accepts like the first, the last column multiplies the measured "
        "per-depth rates. Teacher forcing scores the head on human-written ShareGPT replies; "
        "decoding drafts the target's own output, which is easier to predict.",
    ]
    if card.get("kind_choice"):
        lines += ["", "## Why an EAGLE head", "", card["kind_choice"]["summary"]]
    lines += [
        "",
        "## Reproduce",
        "",
        "```bash",
        card["command"],
        ".venv/bin/python -m bench.draft_acceptance   # re-measures the acceptance above",
        "```",
        "",
    ]
    return "\n".join(lines)


def coverage(draft_ids: Sequence[int], tokens: Sequence[int]) -> float:
    inside = set(draft_ids)
    return sum(t in inside for t in tokens) / max(len(tokens), 1)


def shortfall(split: dict[str, Any]) -> str:
    """Say so when the dataset held fewer usable conversations than were asked for."""
    asked = int(split.get("requested", 0))
    if asked <= split["conversations"]:
        return ""
    return f"; all the split holds, {asked:,} were asked for"
