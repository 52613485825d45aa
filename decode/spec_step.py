"""One speculative step over a ragged batch: draft, verify in one target forward, accept."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace

import numpy as np
import torch

from decode.drafters.base import Drafter, DraftProposal
from decode.drafters.device_rounds import read_proposals
from decode.processing import Span, process_spans
from decode.rejection import rejection_sample, verify_greedy
from decode.tree_verify import accept_greedy_path
from models.device_copy import HostCopy, to_device
from models.logprobs import TokenLogprob, logprobs_of, token_logprobs
from models.request import Request
from models.sampling import SamplingParams, Stream, inverse_cdf, probs_from_logits, uniforms
from models.tree import TreeSpan, chain_parents, path_moves
from runtime.runner import ModelRunner, SeqInput, StepResult


@dataclass(frozen=True)
class Emission:
    tokens: tuple[int, ...]  # accepted drafts, then the recovered or bonus token; () mid-prompt
    num_drafted: int  # draft tokens tested (a tree: its depth, the positions it offered)
    num_accepted: int
    num_fed: int
    rows: tuple[int, ...] = ()
    logprobs: tuple[TokenLogprob, ...] = ()


NO_DRAFT = DraftProposal((), None)


@dataclass(frozen=True, eq=False)
class SeqStep:
    req: Request
    pending: tuple[int, ...]  # known tokens not yet in the KV cache
    proposal: DraftProposal
    width: int  # output positions it verifies, one logit row each (0: mid-prompt)
    first_row: int
    offset: int

    @property
    def samples(self) -> bool:
        return self.width > 0

    @property
    def is_tree(self) -> bool:
        return self.proposal.parents is not None

    @property
    def num_fed_drafts(self) -> int:
        size = self.proposal.size
        return size if self.is_tree else min(size, max(self.width - 1, 0))

    @property
    def fed_drafts(self) -> tuple[int, ...] | torch.Tensor:
        """The drafts fed to the target: on the host, or [n] on the device (unread)."""
        return _first(self.proposal, self.num_fed_drafts)

    @property
    def num_tested(self) -> int:
        return min(self.proposal.size, self.width)

    @property
    def tested(self) -> tuple[int, ...] | torch.Tensor:
        return _first(self.proposal, self.num_tested)

    @property
    def num_fed(self) -> int:
        return len(self.pending) + self.num_fed_drafts


def _first(p: DraftProposal, n: int) -> tuple[int, ...] | torch.Tensor:
    return p.tokens[:n] if p.unread is None else p.unread[:n]


def _on_device(pieces: Sequence[Sequence[int] | torch.Tensor], dev: torch.device) -> torch.Tensor:
    """[sum n_i] the pieces' tokens in order on ``dev``: the host's in one copy, the device's
    (unread drafts) put in place there."""
    flat: list[int] = []
    at: list[int] = []
    on_dev: list[torch.Tensor] = []
    for piece in pieces:
        if isinstance(piece, torch.Tensor):
            at += range(len(flat), len(flat) + piece.shape[0])
            flat += [0] * piece.shape[0]
            on_dev.append(piece)
        else:
            flat += piece
    out = to_device(flat, dev, torch.long)
    if on_dev:
        out[to_device(at, dev, torch.long)] = torch.cat(on_dev)
    return out


def _propose(
    drafter: Drafter | None, reqs: Sequence[Request], samples: Sequence[bool], ks: Sequence[int]
) -> list[DraftProposal]:
    """``k = 0`` gets only ``propose_free`` (no draft round), except a client-seeded sampled
    request, whose tokens must not depend on k. Position 0 is never drafted, as on prefill."""
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


def _seq_steps(
    drafter: Drafter | None,
    reqs: Sequence[Request],
    new_tokens: Sequence[int],
    ks: Sequence[int],
) -> list[SeqStep]:
    pending = [
        r.token_slice(r.num_computed, r.num_computed + n)
        for r, n in zip(reqs, new_tokens, strict=True)
    ]
    samples = [r.num_computed + n == r.num_tokens for r, n in zip(reqs, new_tokens, strict=True)]
    proposals = _propose(drafter, reqs, samples, ks)
    steps: list[SeqStep] = []
    row = offset = 0
    for r, pend, sample, prop, k in zip(reqs, pending, samples, proposals, ks, strict=True):
        width = _width(prop, k) if sample else 0
        s = SeqStep(r, tuple(pend), prop, width, row, offset)
        steps.append(s)
        row += width
        offset += s.num_fed
    return steps


def _width(prop: DraftProposal, k: int) -> int:
    if prop.parents is not None:
        return prop.size + 1
    return min(prop.size, k) + 1


@dataclass(frozen=True, eq=False)
class Launched:
    """A step whose device work is queued: ``land_step`` reads its one copy and accepts."""

    drafter: Drafter | None
    steps: list[SeqStep]
    out: StepResult
    chains: list[SeqStep]
    trees: list[SeqStep]
    counts: torch.Tensor | None  # [3, C] on the device, the chains in ``order``
    order: list[SeqStep]
    unread: list[SeqStep]
    read: Staged

    def sampled(self) -> dict[str, torch.Tensor]:
        """Per request id, [1] on the device: the last token its chain step emits (a plain
        decode's one token), before the read."""
        if self.counts is None:
            return {}
        finals = self.counts[2]  # [C]
        return {s.req.request_id: finals[j : j + 1] for j, s in enumerate(self.order)}


def decode_step(
    target: ModelRunner,
    drafter: Drafter | None,
    reqs: Sequence[Request],
    new_tokens: Sequence[int],
    ks: Sequence[int],
    while_waiting: Callable[[], None] | None = None,
) -> list[Emission]:
    """Advance every request by one step; ``ks[i]`` extra positions may be verified for it.
    ``while_waiting``: host work run once the step's device work is queued, before its read
    waits on it (on a GPU it overlaps the forward)."""
    launched = launch_step(target, drafter, reqs, new_tokens, ks)
    if while_waiting is not None:
        while_waiting()
    return land_step(launched)


def launch_step(
    target: ModelRunner,
    drafter: Drafter | None,
    reqs: Sequence[Request],
    new_tokens: Sequence[int],
    ks: Sequence[int],
    pending_on_device: Mapping[str, torch.Tensor] | None = None,
) -> Launched:
    """Draft, queue the target's forward and the verification, and queue their copy to the
    host. ``pending_on_device``: [1] per request whose pending token is still unread (the
    previous step's, landed after this one is launched), by request id; its host token is a
    placeholder."""
    on_dev = pending_on_device or {}
    steps = _seq_steps(drafter, reqs, new_tokens, ks)
    unread = [s for s in steps if s.proposal.unread is not None]
    if unread and not target.takes_device_ids:  # a runner that takes its tokens on the host
        steps = _read_drafts(steps)
        unread = []
        if drafter is not None:
            drafter.settle()
    batch = [_seq_input(s) for s in steps]
    for r in reqs:
        r.kv_moves = ()
    if unread or on_dev:
        assert target.takes_device_ids, f"{type(target).__name__} takes its tokens on the host"
        first = next(iter(on_dev.values())) if on_dev else unread[0].proposal.unread
        assert first is not None
        pieces = [p for s in steps for p in (on_dev.get(s.req.request_id, s.pending), s.fed_drafts)]
        out = target.run(batch, _on_device(pieces, first.device))
    else:
        out = target.run(batch)

    for s in steps:
        if not s.samples:
            _observe(drafter, s.req, out.all_hidden[s.offset : s.offset + len(s.pending)])
            s.req.num_computed += len(s.pending)
    chains = [s for s in steps if s.samples and not s.is_tree]
    trees = [s for s in steps if s.samples and s.is_tree]
    counts, order = _verify_chains(out, chains)  # [3, C] on the device
    # [1 + nodes] per tree: every row's argmax, read with the chains' counts
    best = [out.argmax(slice(s.first_row, s.first_row + s.width)) for s in trees]
    # one token, no draft tested: the token the step emits is its final one
    asked = [
        s
        for s in chains
        if s.width == 1 and not s.num_tested and s.req.sampling.logprobs is not None
    ]
    logprobs = _logprobs_on_device(out, counts, order, asked)
    read = _stage(counts, best, unread, logprobs)
    return Launched(drafter, steps, out, chains, trees, counts, order, unread, read)


def land_step(launched: Launched, advanced: bool = False) -> list[Emission]:
    """Wait for the step's one copy and accept its tokens. ``advanced``: its requests'
    computed counts already took their pending token (a step launched before this one landed
    was planned on them)."""
    lc, drafter = launched, launched.drafter
    verdicts, bests, drafted, staged = _read_once(lc.read, lc.order, lc.chains)
    if drafter is not None and lc.unread:
        drafter.settle()
    known = {s: _with_tokens(s, t) for s, t in zip(lc.unread, drafted, strict=True)}
    got = {s: _accept_tree(drafter, s, lc.out, b) for s, b in zip(lc.trees, bests, strict=True)}
    for s, (n, final) in zip(lc.chains, verdicts, strict=True):
        got[s] = _accept_chain(drafter, known.get(s, s), lc.out, n, final, advanced)
    emissions = [got[s] if s.samples else Emission((), 0, 0, s.num_fed) for s in lc.steps]
    emissions = [
        replace(em, logprobs=(staged[s],)) if s in staged else em
        for s, em in zip(lc.steps, emissions, strict=True)
    ]
    return _with_logprobs(lc.out.logits, lc.steps, emissions)


def _logprobs_on_device(
    out: StepResult, counts: torch.Tensor | None, order: Sequence[SeqStep], asked: list[SeqStep]
) -> StagedLogprobs | None:
    """One-token chain steps' logprobs, computed where their token is (``models.logprobs``'
    arithmetic, on the device), for the step's one copy: the read then needs no second one."""
    if not asked or counts is None:
        return None
    dev = out.logits.device
    col = {s: j for j, s in enumerate(order)}
    rows = to_device([s.first_row for s in asked], dev)  # [N]
    tokens = counts[2][to_device([col[s] for s in asked], dev)]  # [N] each one's final token
    tops = tuple(s.req.sampling.logprobs or 0 for s in asked)
    values, top_ids = logprobs_of(out.logits[rows], tokens, max(tops))  # [N, 1 + k], [N, k]
    return StagedLogprobs(tuple(asked), tops, values, top_ids)


def _with_logprobs(
    logits: torch.Tensor, steps: Sequence[SeqStep], emissions: list[Emission]
) -> list[Emission]:
    asks = [
        i
        for i, (s, em) in enumerate(zip(steps, emissions, strict=True))
        if em.tokens and s.req.sampling.logprobs is not None and not em.logprobs
    ]
    if not asks:
        return emissions
    rows = [row for i in asks for row in emissions[i].rows]
    tokens = [t for i in asks for t in emissions[i].tokens]
    tops = [steps[i].req.sampling.logprobs or 0 for i in asks for _ in emissions[i].tokens]
    index = to_device(rows, logits.device)
    got = iter(token_logprobs(logits[index], tokens, tops))
    for i in asks:
        em = emissions[i]
        emissions[i] = replace(em, logprobs=tuple(next(got) for _ in em.tokens))
    return emissions


def _read_drafts(steps: Sequence[SeqStep]) -> list[SeqStep]:
    props = read_proposals([s.proposal for s in steps])
    return [replace(s, proposal=p) for s, p in zip(steps, props, strict=True)]


def _with_tokens(s: SeqStep, tokens: Sequence[int]) -> SeqStep:
    return replace(s, proposal=replace(s.proposal, tokens=tuple(tokens), unread=None))


@dataclass(frozen=True, eq=False)
class StagedLogprobs:
    steps: tuple[SeqStep, ...]
    tops: tuple[int, ...]
    values: torch.Tensor  # [N, 1 + k] fp32: each token's logprob, then the top k's
    top_ids: torch.Tensor  # [N, k]


@dataclass(frozen=True)
class Staged:
    """The step's one device->host copy, queued: the chains' counts, then each tree's rows'
    argmax, then the drafts left on the device, then the staged logprobs' top ids and their
    fp32 values (as their bits)."""

    copy: HostCopy | None
    num_chains: int
    tree_sizes: tuple[int, ...]
    draft_sizes: tuple[int, ...]
    logprobs: StagedLogprobs | None = None


def _stage(
    counts: torch.Tensor | None,
    best: Sequence[torch.Tensor],
    unread: Sequence[SeqStep],
    logprobs: StagedLogprobs | None = None,
) -> Staged:
    drafts = [s.proposal.unread for s in unread if s.proposal.unread is not None]
    parts = ([] if counts is None else [counts.reshape(-1)]) + list(best) + drafts
    if logprobs is not None:  # fp32 bits ride in the int64 copy: still one copy to wait on
        bits = logprobs.values.reshape(-1).contiguous().view(torch.int32).long()
        parts += [logprobs.top_ids.reshape(-1), bits]
    c = 0 if counts is None else counts.shape[1]
    trees, rows = tuple(b.shape[0] for b in best), tuple(d.shape[0] for d in drafts)
    copy = HostCopy(torch.cat(parts)) if parts else None
    return Staged(copy, c, trees, rows, logprobs)


def _read_once(
    staged: Staged, order: Sequence[SeqStep], chains: Sequence[SeqStep]
) -> tuple[
    list[tuple[int, int | None]], list[list[int]], list[list[int]], dict[SeqStep, TokenLogprob]
]:
    """The step's one read: per chain (drafts accepted, the recovered or bonus token or None),
    per tree its rows' argmax, the drafts that were left on the device, and the staged
    logprobs by step."""
    if staged.copy is None:
        return [], [], [], {}
    flat = staged.copy.tolist()
    c = staged.num_chains
    n, has, final = flat[:c], flat[c : 2 * c], flat[2 * c : 3 * c]
    got = {s: (n[j], final[j] if has[j] else None) for j, s in enumerate(order)}
    at = 3 * c
    pieces: list[list[int]] = []
    for size in staged.tree_sizes + staged.draft_sizes:
        pieces.append(flat[at : at + size])
        at += size
    trees = len(staged.tree_sizes)
    lp = staged.logprobs
    if lp is None:
        return [got[s] for s in chains], pieces[:trees], pieces[trees:], {}
    k = lp.top_ids.shape[1]
    bits = np.asarray(flat[at + len(lp.steps) * k :], dtype=np.int64).astype(np.int32)
    values = bits.view(np.float32).tolist()
    logprobs = {}
    for i, (s, top) in enumerate(zip(lp.steps, lp.tops, strict=True)):
        v = values[i * (1 + k) : (i + 1) * (1 + k)]
        ids = flat[at + i * k : at + i * k + top]
        token = got[s][1]
        assert token is not None  # a one-token chain always has its final token
        logprobs[s] = TokenLogprob(token, v[0], tuple(zip(ids, v[1 : 1 + top], strict=True)))
    return [got[s] for s in chains], pieces[:trees], pieces[trees:], logprobs


def _verify_chains(
    out: StepResult, chains: Sequence[SeqStep]
) -> tuple[torch.Tensor | None, list[SeqStep]]:
    """[3, C] on the device: per chain, drafts accepted, whether a final token follows, and
    that token; and the chains in the order of its columns."""
    if not chains:
        return None, []
    logits = out.logits  # [rows, V]
    dev = logits.device
    # a processed greedy chain takes the sampled path: its one-hot rows come after processing
    greedy = [s for s in chains if s.req.sampling.greedy and not s.req.sampling.processes]
    sampled = [s for s in chains if s not in greedy]
    counts: list[torch.Tensor] = []  # [3, B] per group: accepted, has final, final token
    for group in (greedy, sampled):
        if not group:
            continue
        if group is greedy and all(s.width == 1 for s in group):
            # one row a chain: compare each row's argmax with its free draft, if any
            rows_of = [s.first_row for s in group]
            every = rows_of == list(range(logits.shape[0]))
            final = out.argmax(slice(None) if every else rows_of)  # [B]
            free = _on_device([s.tested if s.num_tested else (-1,) for s in group], dev)  # [B]
            n = (final == free).long()  # [B] the free draft passed
            counts.append(torch.stack([n, 1 - n, final]))
            continue
        rows = to_device([s.first_row + j for s in group for j in range(s.width)], dev)  # [sum w_i]
        drafts = _on_device([s.tested for s in group], dev)  # [sum t_i]
        ws, ts = [s.width for s in group], [s.num_tested for s in group]
        if group is greedy:
            g = verify_greedy(out.argmax(rows), ws, drafts, ts)
            counts.append(torch.stack([g.num_accepted, g.has_final.long(), g.final_token]))
            continue
        members = [s.req for s in group]
        first = itertools.accumulate(ws, initial=0)
        spans = [Span(s.req, f, _ahead(s)) for s, f in zip(group, first, strict=False)]
        scored = process_spans(logits[rows], spans)  # [sum w_i, V]
        p = probs_from_logits(scored, _positions(members, ws)[0])  # [sum w_i, V]
        u = torch.from_numpy(uniforms(*_positions(members, ts), Stream.ACCEPT))  # [sum t_i]
        ver = rejection_sample(p, ws, drafts, ts, _draft_probs(group, p), u)
        final = _draw_finals(ver.final_dist, ver.num_accepted, members, ws)
        counts.append(torch.stack([ver.num_accepted, ver.has_final.long(), final]))
    return torch.cat(counts, dim=1), greedy + sampled


def _draw_finals(
    dist: torch.Tensor, accepted: torch.Tensor, reqs: Sequence[Request], widths: Sequence[int]
) -> torch.Tensor:
    """[B] each sampled chain's final token, drawn from ``dist`` [B, V] where it landed."""
    u_all = uniforms(*_positions(reqs, widths), Stream.SAMPLE)  # [sum w_i]
    ws = to_device(list(widths), dist.device)
    landed = torch.cumsum(ws, 0) - ws + accepted.clamp(max=ws - 1)  # [B] its position's row
    return inverse_cdf(dist, torch.from_numpy(u_all).to(dist.device, non_blocking=True)[landed])


def _positions(
    reqs: Sequence[Request], counts: Sequence[int]
) -> tuple[list[SamplingParams], list[int]]:
    params: list[SamplingParams] = []
    positions: list[int] = []
    for r, c in zip(reqs, counts, strict=True):
        first = len(r.output_token_ids)
        params += [r.sampling] * c
        positions += range(first, first + c)
    return params, positions


def _draft_probs(group: Sequence[SeqStep], p: torch.Tensor) -> torch.Tensor | None:
    """[sum t_i, V] the tested drafts' distributions, or None when every draft is one-hot."""
    if all(s.proposal.probs is None for s in group):
        return None
    rows = []
    for s in group:
        probs = s.proposal.probs
        if probs is not None:
            rows.append(probs[: s.num_tested].to(p.device))
        elif s.num_tested:
            ids = _on_device([s.tested], p.device)
            rows.append(torch.nn.functional.one_hot(ids, p.shape[1]).to(p.dtype))
    return torch.cat(rows) if rows else None


def _seq_input(s: SeqStep) -> SeqInput:
    r, n = s.req, len(s.pending)
    sp = r.sampling
    only = sp.greedy and sp.logprobs is None and not sp.processes
    logit_rows = list(range(n - 1, n - 1 + s.width))
    fed = s.fed_drafts  # unread drafts: placeholders, their ids taken from the device
    tokens = [*s.pending, *(fed if isinstance(fed, tuple) else [0] * s.num_fed_drafts)]
    if s.proposal.parents is None:
        return SeqInput(
            r.block_table, r.num_computed, tokens, logit_rows, kv_moves=r.kv_moves, argmax_only=only
        )
    # the pending tokens as a chain, the draft tree hanging from the last of them
    parents = chain_parents(n) + tuple(n - 1 if q < 0 else n + q for q in s.proposal.parents)
    return SeqInput(
        r.block_table,
        r.num_computed,
        tokens,
        logit_rows,
        TreeSpan(r.num_computed, parents),
        r.kv_moves,
        only,
    )


def _accept_chain(
    drafter: Drafter | None,
    s: SeqStep,
    out: StepResult,
    n: int,
    final: int | None,
    advanced: bool = False,
) -> Emission:
    r, tested = s.req, s.proposal.tokens[: s.width]
    emitted = tested[:n] + ((final,) if final is not None else ())
    valid = len(s.pending) + min(n, s.width - 1)  # in KV: pending and the fed accepted drafts
    _observe(drafter, r, out.all_hidden[s.offset : s.offset + valid])
    if not advanced:
        r.num_computed += valid
    r.num_draft_computed = min(r.num_draft_computed, r.num_computed)
    rows = tuple(range(s.first_row, s.first_row + len(emitted)))
    return Emission(emitted, len(tested), n, s.num_fed, rows)


def _accept_tree(
    drafter: Drafter | None, s: SeqStep, out: StepResult, best: Sequence[int]
) -> Emission:
    """``best``: the argmax of the tree's rows (its root's, then each node's)."""
    r, prop = s.req, s.proposal
    assert prop.parents is not None
    path, final = accept_greedy_path(list(best), prop.tokens, prop.parents)
    n = len(s.pending)
    rows = list(range(s.offset, s.offset + n)) + [s.offset + n + node for node in path]
    _observe(drafter, r, out.all_hidden[to_device(rows, out.all_hidden.device)])
    r.kv_moves = path_moves(r.num_computed + n, path)
    r.num_computed += n + len(path)
    r.num_draft_computed = min(r.num_draft_computed, r.num_computed)
    depth = max(TreeSpan(0, prop.parents).depths()) + 1
    emitted = (*(prop.tokens[node] for node in path), final)
    # a token comes from the row after its parent: the root (row 0) or the node before it
    produced = tuple(s.first_row + row for row in (0, *(1 + node for node in path)))
    return Emission(emitted, depth, len(path), s.num_fed, produced)


def _ahead(s: SeqStep) -> tuple[int, ...]:
    """The drafts a processed row's span scores after (a processing request's are read: its
    drafter's rounds needed them on the host)."""
    if s.proposal.unread is not None:
        if s.req.sampling.processes:
            raise RuntimeError(f"request {s.req.request_id} processes but its drafts are unread")
        return ()
    return s.proposal.tokens[: s.width - 1]


def _observe(drafter: Drafter | None, r: Request, features: torch.Tensor) -> None:
    if drafter is not None and drafter.needs_features:
        drafter.observe(r, features)
