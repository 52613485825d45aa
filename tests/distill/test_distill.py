"""``tandem distill`` on a tiny random target: the dense training forward is the paged serving
forward, the loss falls, the shipped head loads into the decode path with the same outputs, and
a resumed run ends exactly where an uninterrupted one does."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from bench.draft_topk import topk_agreement
from cluster.cli import main
from distill.card import shortfall
from distill.data import load_corpus
from distill.objective import unrolled_forward
from distill.sharegpt import Conversation, held_out
from distill.train import TrainConfig, make_head, train
from models.config import LlamaConfig
from models.eagle import EagleConfig, EagleHead, load_eagle
from models.kv_layout import kv_pool_shape
from models.weights import load_state_dict
from runtime.runner import EagleRunner, SeqInput
from tests.helpers import make_tiny_checkpoint

WORDS = [
    "the",
    "cat",
    "sat",
    "on",
    "a",
    "mat",
    "while",
    "two",
    "dogs",
    "ran",
    "to",
    "the",
    "park",
    "and",
    "back",
    "again",
    "before",
    "dinner",
]


def _sharegpt_file(path: Path, n: int) -> Path:
    """A small ShareGPT-format file, cut off mid-record like the packaged one."""
    records = []
    for i in range(n):
        a = " ".join(WORDS[(i + j) % len(WORDS)] for j in range(30 + i % 7))
        records.append(
            {
                "id": f"c{i:03d}_0",
                "conversations": [
                    {"from": "human", "value": f"Tell me story number {i}."},
                    {"from": "gpt", "value": a},
                    {"from": "human", "value": "And again?"},
                    {"from": "gpt", "value": a.upper()},
                ],
            }
        )
    text = json.dumps(records)
    path.write_text(text[: len(text) - 40])  # the last record is incomplete
    return path


def _head(target: Path, vocab: int = 300, seed: int = 0, eagle3: bool = False) -> EagleHead:
    w = load_state_dict(target)
    embed = w["model.embed_tokens.weight"].float()
    cfg = LlamaConfig.from_folder(target)
    norm = w["model.norm.weight"].float()
    return make_head(cfg, embed, embed, torch.arange(vocab), seed, "cpu", eagle3, norm)


def _runner(head: EagleHead) -> EagleRunner:
    c = head.cfg.layer
    return EagleRunner(head, torch.zeros(kv_pool_shape(4, c.num_kv_heads, 1, 16, c.head_dim)), 16)


@pytest.fixture(scope="module")
def deep_folder(embedded_folder: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny target with the four layers EAGLE-3's default streams need."""
    return make_tiny_checkpoint(tmp_path_factory.mktemp("deep"), embedded_folder, 5, num_layers=4)


@pytest.mark.parametrize("eagle3", [False, True], ids=["eagle", "eagle3"])
def test_dense_unrolled_forward_is_the_paged_drafting_path(
    tiny_folder: Path, deep_folder: Path, eagle3: bool
) -> None:
    head = _head(deep_folder if eagle3 else tiny_folder, eagle3=eagle3)
    with torch.no_grad():  # move away from the pass-through initialisation
        for p in head.layer.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(1)) * 0.05)
    ids = torch.randint(3, 300, (1, 20), generator=torch.Generator().manual_seed(2))
    width = head.cfg.feature_width  # H, or EAGLE-3's three target streams
    feats = torch.randn(1, 20, width, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        g1, g2, g3 = unrolled_forward(head, ids, feats, 3)
    paged = _runner(head).run([SeqInput([0, 1], 0, ids[0].tolist(), list(range(20)))], feats[0])
    assert (paged.all_hidden - g1[0]).abs().max() <= 1e-4
    assert (head.logits(g1[0]) - paged.logits).nan_to_num(0.0, 0.0, 0.0).abs().max() <= 1e-4
    # A chain that starts at position s - 1 drafts its 2nd and 3rd tokens from its own features,
    # over the head's KV of true features up to s - 1 (what decode/drafters/eagle.py does).
    for s in (2, 9, 17):
        runner = _runner(head)
        table = [0, 1]
        runner.run([SeqInput(table, 0, ids[0, :s].tolist(), [s - 1])], feats[0, :s])
        own = g1[0, s - 1 : s]
        step2 = runner.run([SeqInput(table, s, [int(ids[0, s])], [0])], own, False)
        assert (step2.hidden[0] - g2[0, s]).abs().max() <= 1e-4
        step3 = runner.run([SeqInput(table, s + 1, [int(ids[0, s + 1])], [0])], step2.hidden, False)
        assert (step3.hidden[0] - g3[0, s + 1]).abs().max() <= 1e-4


def test_distill_trains_ships_and_loads_into_the_decode_path(
    tiny_folder: Path, tmp_path: Path
) -> None:
    data = _sharegpt_file(tmp_path / "sharegpt.json", 24)
    out, work = tmp_path / "draft", tmp_path / "work"
    args = ["distill", "--target", str(tiny_folder), "--out", str(out), "--work-dir", str(work)]
    args += ["--dataset", str(data), "--train-conversations", "16", "--eval-conversations", "4"]
    args += ["--held-out-per-mille", "250", "--max-len", "96", "--draft-vocab", "400"]
    args += ["--steps", "20", "--batch-tokens", "400", "--lr", "1e-2", "--warmup", "1"]
    args += ["--checkpoint-every", "5", "--eval-depth", "3", "--save-dtype", "float32"]
    assert main(args) == 0

    card = json.loads((out / "card.json").read_text())
    losses = [h["loss"] for h in torch.load(work / "checkpoint.pt", weights_only=False)["history"]]
    assert len(losses) == 20 and sum(losses[-3:]) / 3 < 0.8 * sum(losses[:3]) / 3
    eval_ids = load_corpus(work / "features-eval").conv_ids
    train_ids = load_corpus(work / "features-train").conv_ids
    assert len(eval_ids) == card["data"]["eval"]["conversations"] > 0
    assert all(_is_held(c) for c in eval_ids) and not any(_is_held(c) for c in train_ids)
    assert card["data"]["train"]["conversations"] == card["data"]["train"]["requested"] == 16
    assert [a["temperature"] for a in card["held_out_acceptance"]] == [0.0, 0.7]
    assert all(
        0.0 <= x <= 1.0 for a in card["held_out_acceptance"] for x in a["acceptance_per_depth"]
    )
    assert (out / "README.md").read_text().startswith("# draft")

    # The shipped folder serves: load_eagle + EagleRunner give the trained head's outputs.
    shipped = load_eagle(out, tiny_folder, torch.float32, "cpu")
    assert shipped.cfg.draft_vocab_size == 400
    corpus = load_corpus(work / "features-eval")
    f, x, _ = corpus.row(0)
    n = min(x.shape[0] - 1, 60)
    trained = _head(tiny_folder, 400)
    ck = torch.load(work / "checkpoint.pt", weights_only=False)
    trained.load_state_dict({**trained.state_dict(), **ck["params"]})
    trained.d2t.copy_(shipped.d2t)
    trained.lm_head.weight.data.copy_(ck["params"]["lm_head.weight"])
    with torch.no_grad():
        (dense,) = unrolled_forward(
            trained, x[1 : n + 1].unsqueeze(0), f[:n].float().unsqueeze(0), 1
        )
    served = _runner(shipped).run(
        [SeqInput([0, 1, 2, 3], 0, x[1 : n + 1].tolist(), list(range(n)))], f[:n].float()
    )
    assert (served.all_hidden - dense[0]).abs().max() <= 1e-4
    assert torch.equal(served.logits.argmax(-1), trained.logits(dense[0]).argmax(-1))

    # bench.draft_topk on the same run: top-1 at depth 1 is the card's greedy acceptance, and a
    # wider top-k can only find the target's token more often.
    report = topk_agreement(out, str(tiny_folder), work / "features-eval", 2, (1, 2, 8))
    d1 = report["topk_by_depth"]["depth_1"]
    assert d1["top1"] <= d1["top2"] <= d1["top8"] <= 1.0
    greedy = card["held_out_acceptance"][0]
    assert greedy["temperature"] == 0.0
    assert abs(d1["top1"] - greedy["acceptance_per_depth"][0]) < 2e-3


def test_an_eagle3_head_is_distilled_and_shipped_only_if_it_beats_the_head_there(
    deep_folder: Path, tmp_path: Path
) -> None:
    """``--kind eagle3`` trains a head on three target streams and ships it in the published
    layout; where ``--out`` already holds a head for the target, both are measured on the same
    held-out conversations and the better one stays in ``--out``."""
    data = _sharegpt_file(tmp_path / "sharegpt.json", 24)
    out = tmp_path / "draft"
    common = ["--target", str(deep_folder), "--out", str(out), "--dataset", str(data)]
    common += ["--train-conversations", "16", "--eval-conversations", "4"]
    common += ["--held-out-per-mille", "250", "--max-len", "96", "--draft-vocab", "400"]
    common += ["--batch-tokens", "400", "--lr", "1e-2", "--warmup", "1", "--eval-depth", "3"]
    common += ["--save-dtype", "float32", "--checkpoint-every", "50"]
    assert main(["distill", *common, "--work-dir", str(tmp_path / "w1"), "--steps", "20"]) == 0
    first = json.loads((out / "card.json").read_text())
    assert first["kind"] == "eagle" and "against_incumbent" not in first

    work = tmp_path / "w3"
    args = ["distill", *common, "--work-dir", str(work), "--steps", "20", "--kind", "eagle3"]
    assert main(args) == 0
    corpus = load_corpus(work / "features-eval")
    assert corpus.aux is not None and corpus.aux.shape == (corpus.num_tokens, 3 * 64)
    assert corpus.aux_layers == (2, 2, 1)  # (2, L // 2, L - 3) for four layers
    replaced = json.loads((out / "card.json").read_text())["kind"] == "eagle3"
    dest = out if replaced else work / "candidate"
    card = json.loads((dest / "card.json").read_text())
    vs = card["against_incumbent"]
    assert card["kind"] == "eagle3" and vs["kind"] == "eagle" and vs["replaced"] == replaced
    # The incumbent measured on this run's conversations is what its own run measured.
    own = first["held_out_acceptance"][0]["chain_tokens_per_forward"]["k=3"]
    assert abs(vs["greedy_chain_tokens"] - own) <= 1e-3
    assert replaced == (vs["candidate_greedy_chain_tokens"] >= vs["greedy_chain_tokens"])
    if not replaced:
        assert EagleConfig.from_folder(out).eagle3 is False  # the better head stayed

    # What was shipped is the trained head, in the published EAGLE-3 layout.
    shipped = load_eagle(dest, deep_folder, torch.float32, "cpu")
    assert shipped.cfg.eagle3 and shipped.cfg.aux_layers == (2, 2, 1)
    params = torch.load(work / "checkpoint.pt", weights_only=False)["params"]
    assert torch.equal(shipped.fc.weight, params["fc.weight"])
    assert torch.equal(shipped.lm_head.weight, params["lm_head.weight"])
    losses = [h["loss"] for h in torch.load(work / "checkpoint.pt", weights_only=False)["history"]]
    assert sum(losses[-3:]) / 3 < 0.8 * sum(losses[:3]) / 3


def _is_held(conv_id: str) -> bool:
    return held_out(Conversation(conv_id, ()), 250)


@pytest.mark.parametrize("depth", [2])
def test_resumed_training_equals_an_uninterrupted_run(
    tiny_folder: Path, tmp_path: Path, depth: int
) -> None:
    data = _sharegpt_file(tmp_path / "sharegpt.json", 12)
    work = tmp_path / "work"
    args = ["distill", "--target", str(tiny_folder), "--out", str(tmp_path / "o"), "--work-dir"]
    args += [str(work), "--dataset", str(data), "--train-conversations", "8"]
    args += ["--eval-conversations", "2", "--held-out-per-mille", "250", "--max-len", "64"]
    args += ["--steps", "1", "--draft-vocab", "300"]
    assert main(args) == 0  # builds the feature caches
    corpus = load_corpus(work / "features-train")
    rows = load_state_dict(tiny_folder)["model.embed_tokens.weight"].float()[:300]
    cfg = TrainConfig(
        steps=6, batch_tokens=200, lr=3e-3, warmup=2, depth=depth, checkpoint_every=100
    )

    whole = _head(tiny_folder)
    full = train(whole, corpus, rows, cfg, tmp_path / "a.pt")
    part = _head(tiny_folder)
    stopped = train(part, corpus, rows, cfg, tmp_path / "b.pt", until=3)
    assert stopped.step == 3
    resumed_head = _head(tiny_folder)  # a fresh process: weights come from the checkpoint
    resumed = train(resumed_head, corpus, rows, cfg, tmp_path / "b.pt")
    assert resumed.step == 6 and [h.step for h in resumed.history] == list(range(1, 7))
    assert [h.loss for h in resumed.history] == [h.loss for h in full.history]
    for (name, a), b in zip(whole.named_parameters(), resumed_head.parameters(), strict=True):
        assert torch.equal(a, b), name
    with pytest.raises(ValueError, match="other training settings"):
        train(_head(tiny_folder), corpus, rows, TrainConfig(steps=7), tmp_path / "b.pt")


def test_card_says_when_the_dataset_ran_out() -> None:
    """Asking for more conversations than the split holds trains on all of them, and the card
    says how many were asked for."""
    assert shortfall({"conversations": 16, "requested": 16}) == ""
    assert shortfall({"conversations": 14266, "requested": 16000}) == (
        "; all the split holds, 16,000 were asked for"
    )
