"""One speculative decoding step over a ragged batch: draft, verify in one forward, accept.

Sequence i brings ``new_tokens[i]`` known tokens not yet in the KV cache (its last sampled
token, or a chunk of a prompt computed locally). Sequences whose tokens reach the end of what
is known sample this step: such a sequence verifies ``w_i = min(m_i, k_i) + 1`` output
positions, where ``m_i`` is how many positions the drafter proposed for (of ``k_i + 1`` asked)
— the target scores its pending tokens plus ``w_i - 1`` drafts in one forward, and the
rejection rule (``decode.rejection``) tests the drafts. KV of rejected positions is rolled back
by lowering the counters (the next step overwrites those slots). A greedy request may bring a
draft tree instead (``DraftProposal.parents``): the target computes every node in the same
forward (``models.tree``), ``decode.tree_verify`` walks it, and the accepted path's KV is
compacted into place at the start of the request's next step.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

import torch

from decode.drafters.base import Drafter, DraftProposal
from decode.rejection import rejection_sample, verify_greedy
from decode.tree_verify import accept_greedy_path
from models.logprobs import TokenLogprob, token_logprobs
from models.request import Request
from models.sampling import SamplingParams, Stream, inverse_cdf, probs_from_logits, uniforms
from models.tree import TreeSpan, chain_parents, path_moves
from runtime.runner import ModelRunner, SeqInput, StepResult


@dataclass(frozen=True)
class Emission:
    """What one step produced for one request."""

    tokens: tuple[int, ...]  # accepted drafts, then the recovered or bonus token; () mid-prompt
    num_drafted: int  # draft tokens tested (a tree: its depth, the positions it offered)
    num_accepted: int
    num_fed: int  # tokens the target computed for this request in this step
    rows: tuple[int, ...] = ()  # each token's row among the request's logit rows
    logprobs: tuple[TokenLogprob, ...] = ()  # one per token when the request asks for them


NO_DRAFT = DraftProposal((), None)


def _propose(
    drafter: Drafter | None, reqs: Sequence[Request], samples: Sequence[bool], ks: Sequence[int]
) -> list[DraftProposal]:
    """Each sampling request's proposal for the ``k + 1`` positions after its known tokens.

    A request granted ``k = 0`` verifies no draft, so a model drafter is not run for it (no
    draft round): it gets only what costs no forward (``Drafter.propose_free``: lookup), which
    keeps its acceptance estimate learning where lookup matches. The exception is a
    client-seeded sampled request: a position's token depends on whether a draft was offered
    there, and offering one at every position keeps its tokens independent of the k the
    planner picked.
    """
    # Position 0 (the first token of a prompt computed here) is never drafted: prefill samples
    # it plainly too, so both modes produce it by the same rule.
    out = [NO_DRAFT] * len(reqs)
    if drafter is None:
        return out
    full: list[int] = []
    free: list[int] = []
    for i, r in enumerate(reqs):
        if samples[i] and r.output_token_ids:
            seeded = r.sampling.seeded and not r.sampling.greedy
            (full if ks[i] > 0 or seeded else free).append(i)
    for ask, propose in ((full, drafter.propose), (free, drafter.propose_free)):
        if ask:
            got = propose([reqs[i] for i in ask], [ks[i] + 1 for i in ask])
            for i, prop in zip(ask, got, strict=True):
                out[i] = prop
    return out


def decode_step(
    target: ModelRunner,
    drafter: Drafter | None,
    reqs: Sequence[Request],
    new_tokens: Sequence[int],
    ks: Sequence[int],
) -> list[Emission]:
    """Advance every request by one step; ``ks[i]`` extra positions may be verified for it."""
    pending = [
        r.token_slice(r.num_computed, r.num_computed + n)
        for r, n in zip(reqs, new_tokens, strict=True)
    ]
    samples = [r.num_computed + n == r.num_tokens for r, n in zip(reqs, new_tokens, strict=True)]
    proposals = _propose(drafter, reqs, samples, ks)
    widths = [
        min(len(p.tokens), k) + 1 if p.parents is None else len(p.tokens) + 1
        for p, k in zip(proposals, ks, strict=True)
    ]
    batch = [
        _seq_input(r, pend, prop, w, sample)
        for r, pend, prop, w, sample in zip(reqs, pending, proposals, widths, samples, strict=True)
    ]
    for r in reqs:
        r.kv_moves = ()  # owed compaction travels with this step (runtime.runner.run_step)
    out = target.run(batch)

    emissions = [Emission((), 0, 0, len(b.token_ids)) for b in batch]
    offsets = [0]
    for b in batch:
        offsets.append(offsets[-1] + len(b.token_ids))
    sampled = [i for i, s in enumerate(samples) if s]
    for i, s in enumerate(samples):
        if not s:
            _observe(drafter, reqs[i], out.all_hidden[offsets[i] : offsets[i] + new_tokens[i]])
            reqs[i].num_computed += new_tokens[i]
    if not sampled:
        return emissions
    # row of each sampled sequence's first distribution in out.logits
    starts = itertools.accumulate((widths[i] for i in sampled), initial=0)
    first_row = dict(zip(sampled, starts, strict=False))  # starts has one more: the end
    chains = [i for i in sampled if proposals[i].parents is None]
    trees = [i for i in sampled if proposals[i].parents is not None]
    verdicts = _verify_chains(out, reqs, proposals, widths, chains, first_row)
    for i in trees:
        best = out.argmax(slice(first_row[i], first_row[i] + widths[i]))  # [w_i]
        emissions[i] = _accept_tree(
            drafter, reqs[i], proposals[i], best, out, offsets[i], pending[i]
        )
    for i, (n, final) in zip(chains, verdicts, strict=True):
        r = reqs[i]
        toks = proposals[i].tokens[: widths[i]]
        emitted = toks[:n] + ((final,) if final is not None else ())
        # KV now holds the pending tokens and the accepted drafts that were fed.
        valid = len(pending[i]) + min(n, widths[i] - 1)
        _observe(drafter, r, out.all_hidden[offsets[i] : offsets[i] + valid])
        r.num_computed += valid
        r.num_draft_computed = min(r.num_draft_computed, r.num_computed)
        produced = tuple(range(len(emitted)))  # a chain's token j comes from its row j
        emissions[i] = Emission(emitted, len(toks), n, len(batch[i].token_ids), produced)
    return _with_logprobs(out.logits, reqs, emissions, first_row)


def _with_logprobs(
    logits: torch.Tensor,
    reqs: Sequence[Request],
    emissions: list[Emission],
    first_row: Mapping[int, int],
) -> list[Emission]:
    """``emissions`` with the target's log-probabilities of each emitted token, for the
    requests that ask for them, read from the rows that produced the tokens (logits: [rows, V])
    in one batch."""
    asks = [
        i
        for i, (r, em) in enumerate(zip(reqs, emissions, strict=True))
        if em.tokens and r.sampling.logprobs is not None
    ]
    if not asks:
        return emissions
    rows = [first_row[i] + row for i in asks for row in emissions[i].rows]
    tokens = [t for i in asks for t in emissions[i].tokens]
    tops = [reqs[i].sampling.logprobs or 0 for i in asks for _ in emissions[i].tokens]
    index = torch.tensor(rows, device=logits.device)
    got = iter(token_logprobs(logits[index], tokens, tops))
    for i in asks:
        em = emissions[i]
        emissions[i] = replace(em, logprobs=tuple(next(got) for _ in em.tokens))
    return emissions


def _verify_chains(
    out: StepResult,
    reqs: Sequence[Request],
    proposals: Sequence[DraftProposal],
    widths: Sequence[int],
    chains: Sequence[int],
    first_row: Mapping[int, int],
) -> list[tuple[int, int | None]]:
    """Per chain: the drafts accepted and the recovered or bonus token after them (None when
    every position was a draft that passed), read from the device in one copy.

    ``out``'s rows are the target's rows of every sampling sequence (``first_row``). Greedy
    chains compare drafts with the argmax (``verify_greedy``, ``StepResult.argmax``); sampled
    ones run the rejection rule over their distributions, and draw the final token at its
    position's uniform.
    """
    if not chains:
        return []
    logits = out.logits  # [rows, V]
    dev = logits.device
    greedy = [i for i in chains if reqs[i].sampling.greedy]
    sampled = [i for i in chains if not reqs[i].sampling.greedy]
    counts: list[torch.Tensor] = []  # [B] per group: accepted, has final, final token
    for group in (greedy, sampled):
        if not group:
            continue
        if group is greedy and all(widths[i] == 1 for i in group):
            # One row a chain (no draft verified; at most a free draft tested against the
            # target's token, ``_propose``): ``verify_greedy`` reduces to comparing each row's
            # argmax with that draft, without its ragged layout.
            rows_of = [first_row[i] for i in group]
            every = rows_of == list(range(logits.shape[0]))
            final = out.argmax(slice(None) if every else rows_of)  # [B]
            free = [proposals[i].tokens[0] if proposals[i].tokens else -1 for i in group]
            n = (final == torch.tensor(free, device=dev)).long()  # [B] the free draft passed
            counts.append(torch.stack([n, 1 - n, final]))
            continue
        rows = torch.tensor(
            [first_row[i] + j for i in group for j in range(widths[i])], device=dev
        )  # [sum w_i]
        tested = [proposals[i].tokens[: widths[i]] for i in group]
        drafts = torch.tensor([t for toks in tested for t in toks], dtype=torch.long, device=dev)
        ws, ts = [widths[i] for i in group], [len(t) for t in tested]
        if group is greedy:
            g = verify_greedy(out.argmax(rows), ws, drafts, ts)
            counts.append(torch.stack([g.num_accepted, g.has_final.long(), g.final_token]))
            continue
        members = [reqs[i] for i in group]
        p = probs_from_logits(logits[rows], _positions(members, ws)[0])  # [sum w_i, V]
        u = torch.from_numpy(uniforms(*_positions(members, ts), Stream.ACCEPT))  # [sum t_i]
        ver = rejection_sample(p, ws, drafts, ts, _draft_probs(group, proposals, tested, p), u)
        final = _draw_finals(ver.final_dist, ver.num_accepted, members, ws)
        counts.append(torch.stack([ver.num_accepted, ver.has_final.long(), final]))
    n, has, final = torch.cat(counts, dim=1).tolist()  # the step's one device->host copy
    order = greedy + sampled
    got = {i: (n[j], final[j] if has[j] else None) for j, i in enumerate(order)}
    return [got[i] for i in chains]


def _draw_finals(
    dist: torch.Tensor, accepted: torch.Tensor, reqs: Sequence[Request], widths: Sequence[int]
) -> torch.Tensor:
    """[B] each sampled chain's recovered or bonus token, drawn from ``dist`` [B, V] at its
    position (after the accepted drafts): the uniforms of every position it could land on are
    computed on the host at once, and the one it did land on is picked on the device."""
    u_all = uniforms(*_positions(reqs, widths), Stream.SAMPLE)  # [sum w_i]
    ws = torch.tensor(list(widths), device=dist.device)
    landed = torch.cumsum(ws, 0) - ws + accepted.clamp(max=ws - 1)  # [B] its position's row
    return inverse_cdf(dist, torch.from_numpy(u_all).to(dist.device)[landed])


def _positions(
    reqs: Sequence[Request], counts: Sequence[int]
) -> tuple[list[SamplingParams], list[int]]:
    """Each request's params and output positions for its next ``counts[i]`` positions."""
    params: list[SamplingParams] = []
    positions: list[int] = []
    for r, c in zip(reqs, counts, strict=True):
        first = len(r.output_token_ids)
        params += [r.sampling] * c
        positions += range(first, first + c)
    return params, positions


def _draft_probs(
    group: Sequence[int],
    proposals: Sequence[DraftProposal],
    tested: Sequence[Sequence[int]],
    p: torch.Tensor,
) -> torch.Tensor | None:
    """[sum t_i, V] the tested drafts' distributions, or None when every draft is one-hot. A
    batch mixing both (lookup-first drafting) gives its one-hot drafts one-hot rows."""
    props = [proposals[i] for i in group]
    if all(prop.probs is None for prop in props):
        return None
    rows = []
    for prop, t in zip(props, tested, strict=True):
        if prop.probs is not None:
            rows.append(prop.probs[: len(t)].to(p.device))
        elif t:
            ids = torch.tensor(list(t), dtype=torch.long, device=p.device)
            rows.append(torch.nn.functional.one_hot(ids, p.shape[1]).to(p.dtype))
    return torch.cat(rows) if rows else None


def _seq_input(
    r: Request, pend: Sequence[int], prop: DraftProposal, width: int, sample: bool
) -> SeqInput:
    """What the target computes for ``r``: its pending tokens, then the drafts it verifies.
    A greedy request that reports no logprobs reads only its rows' argmax."""
    n = len(pend)
    only = r.sampling.greedy and r.sampling.logprobs is None
    if prop.parents is None:
        logit_rows = list(range(n - 1, n - 1 + width)) if sample else []
        return SeqInput(
            r.block_table,
            r.num_computed,
            [*pend, *prop.tokens[: width - 1]],
            logit_rows,
            kv_moves=r.kv_moves,
            argmax_only=only,
        )
    # The pending tokens as a chain, the draft tree hanging from the last of them.
    parents = chain_parents(n) + tuple(n - 1 if q < 0 else n + q for q in prop.parents)
    return SeqInput(
        r.block_table,
        r.num_computed,
        [*pend, *prop.tokens],
        list(range(n - 1, n - 1 + width)),
        TreeSpan(r.num_computed, parents),
        r.kv_moves,
        only,
    )


def _accept_tree(
    drafter: Drafter | None,
    r: Request,
    prop: DraftProposal,
    best: torch.Tensor,
    out: StepResult,
    offset: int,
    pend: Sequence[int],
) -> Emission:
    """Verify a greedy request's draft tree (``decode.tree_verify``) and keep the accepted
    path's KV, compacted into the chain layout at the start of its next step.
    best: [1 + nodes] the target's argmax after the root and after each node."""
    assert prop.parents is not None
    # A greedy request's token is the argmax of its logits (models.sampling.sample_rows).
    path, final = accept_greedy_path(best.tolist(), prop.tokens, prop.parents)
    n = len(pend)
    rows = list(range(offset, offset + n)) + [offset + n + node for node in path]
    _observe(drafter, r, out.all_hidden[torch.tensor(rows, device=out.all_hidden.device)])
    r.kv_moves = path_moves(r.num_computed + n, path)
    r.num_computed += n + len(path)
    r.num_draft_computed = min(r.num_draft_computed, r.num_computed)
    depth = max(TreeSpan(0, prop.parents).depths()) + 1
    emitted = (*(prop.tokens[node] for node in path), final)
    # a token comes from the row after its parent: the root (row 0) or the node before it
    produced = (0, *(1 + node for node in path))
    return Emission(emitted, depth, len(path), n + len(prop.tokens), produced)


def _observe(drafter: Drafter | None, r: Request, features: torch.Tensor) -> None:
    """Hand a drafter that reads target features those of the positions that stayed valid
    (features: [n, H])."""
    if drafter is not None and drafter.needs_features:
        drafter.observe(r, features)
