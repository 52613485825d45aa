"""The rejection rule emits tokens distributed exactly as the target (unit level)."""

from __future__ import annotations

import itertools
import math
from dataclasses import replace

import torch
from scipy.stats import chisquare

from decode.drafters.base import DraftProposal
from decode.rejection import rejection_sample, verify_greedy
from decode.spec_step import SeqStep, _read_once, _stage, _verify_chains
from models.request import Request
from models.sampling import SamplingParams
from runtime.runner import StepResult

V = 6


def _first_token_counts(
    p: torch.Tensor, q: torch.Tensor | None, draft: torch.Tensor, n: int
) -> torch.Tensor:
    """Empirical distribution of the first emitted token over n independent trials (batched)."""
    k = draft.shape[1]
    gen = torch.Generator().manual_seed(0)
    counts = torch.zeros(V)
    batch = 2000
    for _ in range(n // batch):
        if q is not None:
            d = torch.multinomial(q.expand(batch, k, V).reshape(-1, V), 1, generator=gen).view(
                batch, k
            )
        else:
            d = draft.expand(batch, k)
        tp = p.repeat(batch, 1)  # [batch * (k + 1), V]
        dp = q.repeat(batch, 1) if q is not None else None
        u = torch.rand(batch * k, generator=gen)
        ver = rejection_sample(tp, [k + 1] * batch, d.reshape(-1), [k] * batch, dp, u)
        final = torch.multinomial(ver.final_dist, 1, generator=gen).squeeze(1)
        first = torch.where(ver.num_accepted > 0, d[:, 0], final)
        counts += torch.bincount(first, minlength=V).float()
    return counts


def _assert_target(counts: torch.Tensor, p0: torch.Tensor) -> None:
    n = counts.sum()
    mask = p0 > 0
    assert counts[~mask].sum() == 0  # never a token the target excludes
    stat = chisquare(counts[mask].numpy(), (p0[mask] / p0[mask].sum() * n).numpy())
    assert stat.pvalue > 0.01, stat


def test_random_draft_matches_target() -> None:
    g = torch.Generator().manual_seed(1)
    p = torch.softmax(torch.randn(3, V, generator=g) * 2, -1)
    q = torch.softmax(torch.randn(2, V, generator=g) * 2, -1)
    _assert_target(_first_token_counts(p, q, torch.zeros(1, 2, dtype=torch.long), 100_000), p[0])


def test_draft_with_zeros_where_target_has_mass() -> None:
    p = torch.tensor([[0.4, 0.3, 0.2, 0.1, 0.0, 0.0]] * 3)
    q = torch.tensor([[0.0, 0.0, 0.5, 0.0, 0.5, 0.0]] * 2)
    _assert_target(_first_token_counts(p, q, torch.zeros(1, 2, dtype=torch.long), 100_000), p[0])


def test_one_hot_draft_matches_target() -> None:
    p = torch.softmax(torch.randn(4, V, generator=torch.Generator().manual_seed(2)), -1)
    draft = torch.tensor([[3, 1, 2]])
    _assert_target(_first_token_counts(p, None, draft, 100_000), p[0])


def test_greedy_accepts_exactly_the_argmax_prefix() -> None:
    p = torch.zeros(4, V)
    p[0, 2] = p[1, 5] = p[2, 1] = p[3, 0] = 1.0  # greedy target path: 2, 5, 1, then 0
    ver = rejection_sample(p, [4], torch.tensor([2, 5, 3]), [3], None, torch.zeros(3))
    assert int(ver.num_accepted[0]) == 2
    assert int(ver.final_dist[0].argmax()) == 1  # the recovered token is the target's argmax
    ver = rejection_sample(p, [4], torch.tensor([2, 5, 1]), [3], None, torch.zeros(3))
    assert int(ver.num_accepted[0]) == 3 and int(ver.final_dist[0].argmax()) == 0  # bonus


def test_ragged_batch_with_zero_drafts() -> None:
    p = torch.softmax(torch.randn(1 + 4 + 1, V, generator=torch.Generator().manual_seed(3)), -1)
    ver = rejection_sample(
        p, [1, 4, 1], torch.tensor([1, 2, 3]), [0, 3, 0], None, torch.full((3,), 0.999)
    )
    assert ver.num_accepted.tolist()[0] == 0 and ver.num_accepted.tolist()[2] == 0
    assert torch.allclose(ver.final_dist[0], p[0]) and torch.allclose(ver.final_dist[2], p[5])


def test_draft_at_every_row_has_no_bonus() -> None:
    p = torch.zeros(2, V)
    p[0, 2] = p[1, 5] = 1.0
    ver = rejection_sample(p, [2], torch.tensor([2, 5]), [2], None, torch.zeros(2))
    assert int(ver.num_accepted[0]) == 2 and not bool(ver.has_final[0])
    ver = rejection_sample(p, [2], torch.tensor([2, 4]), [2], None, torch.zeros(2))
    assert int(ver.num_accepted[0]) == 1 and bool(ver.has_final[0])
    assert int(ver.final_dist[0].argmax()) == 5


def test_one_hot_rows_verify_exactly_like_one_hot_drafts() -> None:
    """Lookup-first drafting mixes one-hot and model drafts in a batch; the one-hot ones then
    travel as one-hot rows (``decode.spec_step._draft_probs``), which must verify alike."""
    gen = torch.Generator().manual_seed(3)
    rows = [4, 2, 3]
    p = torch.softmax(torch.randn(sum(rows), V, generator=gen), -1)
    drafts = torch.randint(0, V, (sum(r - 1 for r in rows),), generator=gen)
    for trial in range(50):
        u = torch.rand(drafts.numel(), generator=gen)
        plain = rejection_sample(p, rows, drafts, [r - 1 for r in rows], None, u)
        one_hot = torch.nn.functional.one_hot(drafts, V).float()
        rowed = rejection_sample(p, rows, drafts, [r - 1 for r in rows], one_hot, u)
        assert torch.equal(plain.num_accepted, rowed.num_accepted), trial
        assert torch.equal(plain.has_final, rowed.has_final)
        assert torch.allclose(plain.final_dist, rowed.final_dist)


def test_greedy_verification_is_the_rejection_rule_over_one_hot_distributions() -> None:
    """verify_greedy (argmax rows, no distributions) accepts and emits what rejection_sample
    does given one-hot target and draft distributions, on random ragged batches."""
    gen = torch.Generator().manual_seed(1)
    for _ in range(200):
        b = int(torch.randint(1, 6, (1,), generator=gen))
        ws = torch.randint(1, 5, (b,), generator=gen).tolist()
        ts = [w - int(torch.randint(0, 2, (1,), generator=gen)) for w in ws]
        argmax = torch.randint(0, 3, (sum(ws),), generator=gen)  # few tokens: many matches
        drafts = torch.randint(0, 3, (sum(ts),), generator=gen)
        one_hot = torch.nn.functional.one_hot(argmax, V).float()
        ref = rejection_sample(one_hot, ws, drafts, ts, None, torch.zeros(sum(ts)))
        got = verify_greedy(argmax, ws, drafts, ts)
        assert torch.equal(got.num_accepted, ref.num_accepted)
        assert torch.equal(got.has_final, ref.has_final)
        final = ref.final_dist.argmax(dim=1)  # one-hot: the only token it can draw
        assert torch.equal(got.final_token[got.has_final], final[ref.has_final])


def test_single_row_chains_verify_like_verify_greedy() -> None:
    """A step without verified drafts takes a shortcut in ``decode.spec_step`` (each row's
    argmax against at most one free draft); it must give ``verify_greedy``'s verdicts, rows
    in any order, its drafts read or still on the device (read with the verdicts)."""

    logits = torch.randn(5, V, generator=torch.Generator().manual_seed(7))  # [rows, V]
    best = logits.argmax(dim=-1).tolist()
    free = [(), (best[1],), ((best[2] + 1) % V,), (), (best[4],)]  # none, pass, fail, ...
    reqs = [Request(str(i), [1], SamplingParams(temperature=0.0)) for i in range(5)]
    read = [DraftProposal(t, None) for t in free]
    unread = [DraftProposal((), None, unread=torch.tensor(t, dtype=torch.long)) for t in free]
    rows = (1,) * 5
    full = StepResult(torch.zeros(5, 1), logits, rows, torch.zeros(5, 1))
    # a screened head's step: the argmax of every row, its logits not computed
    screened = replace(full, logits=torch.full_like(logits, math.nan), tokens=logits.argmax(-1))
    for out, first_row, props in itertools.product(
        (full, screened), ({i: i for i in range(5)}, {i: 4 - i for i in range(5)}), (read, unread)
    ):
        steps = [SeqStep(reqs[i], (1,), props[i], 1, first_row[i], i) for i in range(5)]
        counts, order = _verify_chains(out, steps)
        on_dev = [s for s in steps if s.proposal.unread is not None]
        got, _, drafted, _ = _read_once(_stage(counts, [], on_dev), order, steps)
        assert drafted == [list(free[i]) for i in range(5) if props is unread]
        for i, (n, final) in enumerate(got):
            row = first_row[i]
            ref = verify_greedy(
                torch.tensor([best[row]]), [1], torch.tensor(list(free[i])), [len(free[i])]
            )
            assert n == int(ref.num_accepted[0])
            assert (final is not None) == bool(ref.has_final[0])
            if final is not None:
                assert final == int(ref.final_token[0]) == best[row]
        if first_row[0] == 0:  # in order: the free drafts of rows 1 and 4 pass
            assert got == [(0, best[0]), (1, None), (0, best[2]), (0, best[3]), (1, None)]


def test_a_steps_argmax_is_torchs_on_ties_nans_and_infinities() -> None:
    """``StepResult.argmax`` (the greedy choice) reduces by ``max``'s indices: the same token
    ``argmax`` gives, the first of equal maxima and a NaN above everything, over slices and
    index lists of the rows."""
    gen = torch.Generator().manual_seed(11)
    logits = torch.randint(-2, 3, (9, 4096), generator=gen).float()  # [9, V]: many ties
    logits[2, 17] = logits[2, 900] = math.nan
    logits[4, 5] = logits[4, 3000] = math.inf
    logits[6] = -math.inf
    out = StepResult(torch.zeros(9, 1), logits, (9,), torch.zeros(9, 1))
    want = logits.argmax(dim=-1)  # [9]
    assert torch.equal(out.argmax(slice(None)), want)
    assert torch.equal(out.argmax(slice(2, 7)), want[2:7])
    assert torch.equal(out.argmax(torch.tensor([6, 2, 4])), want[[6, 2, 4]])
    assert out.argmax(slice(2, 3)).item() == 17 and out.argmax(slice(4, 5)).item() == 5
