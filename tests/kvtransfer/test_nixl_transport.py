"""NIXL moves blocks between two real agents (two pools in one process, UCX loopback)."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from kvtransfer.handoff import KVCompat, KVCompatError, KVHandoff, check_compat
from kvtransfer.nixl_transport import NixlTransport
from kvtransfer.pool import KVGroupSpec, KVPool, KVPoolSpec
from kvtransfer.read_plan import Slice, block_runs, run_descs, slice_descs, slice_rows
from kvtransfer.transport import KVTransferError, PullState

SPEC = KVPoolSpec(
    32, 16, (KVGroupSpec("target", 4, 2, 8, "float32"), KVGroupSpec("draft", 2, 1, 8, "float32"))
)
COMPAT = KVCompat("m", "float32", 16, "layout", 1, "draft", "nixl")


def _handoff(src: NixlTransport, rid: str, blocks: tuple[int, ...]) -> KVHandoff:
    return KVHandoff(rid, src.sources(), blocks, ("target", "draft"), 40, 7, COMPAT, 30.0)


def _pull(
    src: NixlTransport, dst: NixlTransport, handoff: KVHandoff, local: list[int]
) -> list[str]:
    """Pull to completion, progressing the source as its worker's progress thread would;
    return the completion notices the source received."""
    pull = dst.start_pull(handoff, local)
    notices: list[str] = []
    deadline = time.time() + 10
    while (state := dst.poll(pull)) is PullState.PENDING and time.time() < deadline:
        notices += src.completed()
    assert dst.release(pull)
    assert state is PullState.DONE
    while handoff.request_id not in notices and time.time() < deadline:
        notices += src.completed()
    return notices


def test_pull_moves_every_group_bit_exact_and_notifies_source() -> None:
    a, b = KVPool(SPEC), KVPool(SPEC)
    for t in a.tensors.values():
        t.normal_()
    src, dst = NixlTransport(a, "prefill"), NixlTransport(b, "decode")
    notices = _pull(src, dst, _handoff(src, "req-1", (3, 4, 5)), [10, 0, 31])
    for g in ("target", "draft"):
        assert torch.equal(b.tensor(g)[:, [10, 0, 31]], a.tensor(g)[:, [3, 4, 5]])
        assert b.tensor(g)[:, 1].abs().sum() == 0  # nothing else written
    assert notices == ["req-1"]
    per_block = sum(t[:, 0].numel() * 4 for t in a.tensors.values())
    assert dst.counters.bytes_pulled == 3 * per_block and dst.counters.pulls_done == 1


def test_restarted_source_is_re_added_not_read_through_stale_descriptors() -> None:
    a1, b = KVPool(SPEC), KVPool(SPEC)
    a1.tensor("target").fill_(1.0)
    src1, dst = NixlTransport(a1, "prefill"), NixlTransport(b, "decode")
    _pull(src1, dst, _handoff(src1, "r1", (0,)), [0])
    src1.close()
    a2 = KVPool(SPEC)  # a new incarnation: new memory, new agent, new version
    a2.tensor("target").fill_(2.0)
    src2 = NixlTransport(a2, "prefill")
    _pull(src2, dst, _handoff(src2, "r2", (0,)), [1])
    assert torch.all(b.tensor("target")[:, 1] == 2.0)


def test_mismatched_block_sizes_are_refused() -> None:
    other = KVPoolSpec(
        32,
        16,
        (KVGroupSpec("target", 4, 2, 4, "float32"), KVGroupSpec("draft", 2, 1, 8, "float32")),
    )
    src, dst = NixlTransport(KVPool(other), "prefill"), NixlTransport(KVPool(SPEC), "decode")
    with pytest.raises(KVTransferError, match="group target"):
        dst.start_pull(_handoff(src, "r", (1,)), [1])


def test_compat_mismatch_names_both_sides() -> None:
    other = KVCompat("m", "bfloat16", 16, "layout", 1, "draft", "nixl")
    with pytest.raises(KVCompatError, match=r"dtype=float32.*dtype=bfloat16"):
        check_compat(COMPAT, other)
    assert COMPAT.digest() != other.digest()


def test_a_block_is_one_descriptor_or_two_a_layer_for_a_run_of_heads() -> None:
    """The prepared rows of a block cover exactly the bytes of that block's heads: one
    descriptor for every layer of it when every head moves (the pool is block-major), two a
    layer (K and V apart) otherwise."""
    spec = KVPoolSpec(8, 16, (KVGroupSpec("target", 3, 4, 8, "float32"),))
    pool = KVPool(spec)
    t = pool.tensor("target")  # [L, NB, 2, H, BS, D]
    region = NixlTransport(pool, "check").regions[0]
    elem = t.element_size()
    for first, count, whole in ((0, 4, True), (1, 2, False), (3, 1, False)):
        sl = Slice("target", first, count, whole)
        descs = slice_descs(region, sl)
        rows = slice_rows(region, sl, np.array([5]), 0)
        assert len(rows) == (1 if whole else 6)
        got = sorted(
            (int(a), int(a) + int(n)) for a, n, _dev in descs[rows]
        )  # byte ranges of block 5
        want = sorted(
            (
                t[layer, 5, kv, first].data_ptr(),
                t[layer, 5, kv, first].data_ptr() + count * t[layer, 5, kv, 0].numel() * elem,
            )
            for layer in range(3)
            for kv in range(2)
        )
        if whole:  # K and V of every layer in one range
            assert all(want[i][1] == want[i + 1][0] for i in range(5))
            want = [(want[0][0], want[-1][1])]
        assert got == want


def test_a_running_read_is_not_released_until_it_has_ended() -> None:
    """NIXL's UCX backend reports a running READ released yet lands it later, so ``release``
    keeps a read that has not ended (False) and frees it only once it is done."""
    a, b = KVPool(SPEC), KVPool(SPEC)
    a.tensor("target").normal_()
    src, dst = NixlTransport(a, "prefill"), NixlTransport(b, "decode")
    pull = dst.start_pull(_handoff(src, "req-1", (1, 2)), [5, 6])
    time.sleep(0.05)  # the source makes no progress, so the read cannot end
    assert dst.poll(pull) is PullState.PENDING
    assert not dst.release(pull) and len(pull.token) == 1
    deadline = time.time() + 10
    while not dst.release(pull) and time.time() < deadline:
        src.completed()  # the source resumes
    assert not pull.token
    assert torch.equal(b.tensor("target")[:, [5, 6]], a.tensor("target")[:, [1, 2]])


def test_blocks_consecutive_on_both_sides_move_as_one_descriptor_per_run() -> None:
    """A read whose blocks run consecutively on both sides takes one descriptor per run, of
    the whole run's bytes, every layer: the same bytes land as through the per-block lists, and
    nothing else is written."""
    theirs, ours = np.array([3, 4, 5, 9, 10, 20]), np.array([20, 21, 22, 0, 1, 7])
    starts, lengths = block_runs(theirs, ours)
    assert starts.tolist() == [0, 3, 5] and lengths.tolist() == [3, 2, 1]
    a, b = KVPool(SPEC), KVPool(SPEC)
    for t in a.tensors.values():
        t.normal_()
    src, dst = NixlTransport(a, "prefill"), NixlTransport(b, "decode")
    region = src.regions[0]
    rows = run_descs(region, theirs, starts, lengths)
    assert len(rows) == 3  # 3 runs, not 6 blocks
    t = a.tensor("target")
    assert rows[0].tolist() == [t[0, 3].data_ptr(), 3 * region.block_bytes, 0]
    notices = _pull(src, dst, _handoff(src, "runs", tuple(theirs.tolist())), ours.tolist())
    for g in ("target", "draft"):
        assert torch.equal(b.tensor(g)[:, ours.tolist()], a.tensor(g)[:, theirs.tolist()])
        untouched = [i for i in range(SPEC.num_blocks) if i not in set(ours.tolist())]
        assert b.tensor(g)[:, untouched].abs().sum() == 0
    assert notices == ["runs"]


class _Flaky:
    """The real agent, whose next ``check_xfer_state`` raises as a transient NIXL error would."""

    def __init__(self, agent: object, failures: int) -> None:
        self._agent = agent
        self.failures = failures

    def __getattr__(self, name: str) -> object:
        return getattr(self._agent, name)

    def check_xfer_state(self, handle: object) -> str:
        if self.failures:
            self.failures -= 1
            raise RuntimeError("NIXL_ERR_BACKEND: transient")
        state: str = self._agent.check_xfer_state(handle)  # type: ignore[attr-defined]
        return state


def test_an_error_that_does_not_prove_the_read_ended_keeps_its_blocks() -> None:
    """Before, any exception from NIXL counted as "ended" and the blocks were released while
    the read could still land in them."""
    a, b = KVPool(SPEC), KVPool(SPEC)
    a.tensor("target").normal_()
    src, dst = NixlTransport(a, "prefill"), NixlTransport(b, "decode")
    pull = dst.start_pull(_handoff(src, "req-1", (1, 2)), [5, 6])
    dst.agent = _Flaky(dst.agent, failures=2)
    assert dst.poll(pull) is PullState.FAILED  # decode gives up on it
    assert not dst.release(pull) and len(pull.token) == 1  # but holds the blocks
    assert dst.counters.state_unknown == 2
    deadline = time.time() + 10
    while not dst.release(pull) and time.time() < deadline:
        src.completed()
    assert not pull.token  # released once NIXL says it ended


def test_a_malformed_notice_is_counted_and_the_rest_of_its_batch_read() -> None:
    a, b = KVPool(SPEC), KVPool(SPEC)
    src, dst = NixlTransport(a, "prefill"), NixlTransport(b, "decode")
    dst._peer(src.source())
    for msg in (b"\xff\xfe|2", b"req-x|two", b"req-ok|1"):
        dst.agent.send_notif(src.agent_name, msg)
    got: list[str] = []
    deadline = time.time() + 10
    while "req-ok" not in got and time.time() < deadline:
        dst.progress()
        got += src.completed()
    assert got == ["req-ok"] and src.malformed_notices == 2


def test_an_idle_source_is_forgotten_and_reached_again_when_it_returns(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from kvtransfer import nixl_transport

    monkeypatch.setattr(nixl_transport, "PEER_IDLE_S", 0.0)
    a1, a2, b = KVPool(SPEC), KVPool(SPEC), KVPool(SPEC)
    a1.tensor("target").fill_(1.0)
    a2.tensor("target").fill_(2.0)
    s1, s2 = NixlTransport(a1, "prefill"), NixlTransport(a2, "prefill")
    dst = NixlTransport(b, "decode")
    _pull(s1, dst, _handoff(s1, "r1", (0,)), [0])
    _pull(s2, dst, _handoff(s2, "r2", (0,)), [1])  # s1 idle past the bound: evicted
    assert dst.peers_evicted == 1 and set(dst._peers) == {s2.agent_name}
    _pull(s1, dst, _handoff(s1, "r3", (0,)), [2])
    for block, want in ((0, 1.0), (1, 2.0), (2, 1.0)):
        assert (b.tensor("target")[:, block] == want).all()
