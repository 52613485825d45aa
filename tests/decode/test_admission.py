"""Admission (the queue) and a request's further choices, apart from any model."""

from __future__ import annotations

from decode.admission import Admission
from decode.choices import Choices
from kvtransfer.allocator import BlockAllocator
from models.request import Request
from models.sampling import SamplingParams


def _req(rid: str, prompt: int, max_tokens: int = 4, n: int = 1) -> Request:
    return Request(rid, list(range(prompt)), SamplingParams(max_tokens=max_tokens, n=n))


def _admission(allocator: BlockAllocator, stalls: int = 4) -> Admission:
    return Admission(allocator, allocator.num_free, 4, 64, stalls)


def test_the_head_of_the_queue_waits_for_room_and_nothing_passes_it() -> None:
    allocator = BlockAllocator(4)
    queue = _admission(allocator)
    allocator.allocate(2)
    big, small = _req("big", 10), _req("small", 2)  # 11 and 3 slots: 3 blocks and 1
    queue.add(big, None)
    queue.add(small, None)
    assert queue.next(others_running=False) is None  # small would fit, but big is first
    assert [q.req for q in queue.waiting] == [big, small]
    allocator.free([0, 1])
    got = queue.next(others_running=False)
    assert got is not None and got.req is big and len(big.block_table) == 3
    got = queue.next(others_running=True)
    assert got is not None and got.req is small and len(small.block_table) == 1
    assert len(queue.take_queue_times()) == 2 and not queue.take_queue_times()


def test_a_requeued_request_goes_first_and_counts_its_queue_time_once() -> None:
    allocator = BlockAllocator(8)
    queue = _admission(allocator)
    a, b = _req("a", 3), _req("b", 3)
    queue.add(a, None)
    assert queue.next(others_running=False) is not None
    queue.add(b, None)
    a.num_computed = 3
    queue.requeue(a)  # preempted: its KV is dropped, it waits at the head
    assert a.block_table == [] and a.num_computed == 0 and allocator.num_free == 8
    assert [q.req for q in queue.waiting] == [a, b]
    assert queue.next(False) is not None and queue.next(False) is not None
    assert len(queue.take_queue_times()) == 2  # a's first admission and b's, not a's second
    assert queue.remove("a") is False and not queue.waiting


def test_a_request_stalled_by_preemption_waits_for_room_to_finish_then_fails() -> None:
    allocator = BlockAllocator(16)
    queue = _admission(allocator, stalls=3)
    r = _req("r", 5, max_tokens=20)  # 6 slots to start (2 blocks), 26 to finish (7 blocks)
    r.outputs_at_preemption = 0
    assert queue.preempted(r) is None and r.stalled_preemptions == 1
    assert queue.preempted(r) is None and r.stalled_preemptions == 2
    queue.add(r, None)
    got = queue.next(others_running=True)
    assert got is not None and len(r.block_table) == 7
    r.output_token_ids.append(1)  # progress: the count starts over
    assert queue.preempted(r) is None and r.stalled_preemptions == 0
    for _ in range(2):
        assert queue.preempted(r) is None
    error = queue.preempted(r)
    assert error is not None and error.startswith("preempted 3 times in a row")


def test_a_request_that_can_never_fit_is_refused() -> None:
    queue = _admission(BlockAllocator(4))  # 16 slots
    assert queue.refusal(_req("ok", 10, max_tokens=5)) is None  # 16 slots
    refused = queue.refusal(_req("big", 10, max_tokens=6))
    assert refused is not None and "need 17 tokens of KV" in refused and "at most 16" in refused


def test_choices_share_the_prompts_whole_blocks_but_never_its_last_token() -> None:
    for prompt, shared in ((9, 8), (8, 4), (3, 0)):
        allocator = BlockAllocator(8)
        choices = Choices(allocator, 4, drafter_kv=False)
        r = _req("r", prompt, n=3)
        choices.hold(r, source=False)
        r.block_table = allocator.allocate(-(-prompt // 4))
        assert choices.ready({"r": r}) == []  # its prompt is not computed yet
        r.num_computed = prompt
        assert choices.ready({"r": r}) == [r]
        started = choices.start(r)
        assert [c.request_id for c in started] == ["r/1", "r/2"]
        for c in started:
            assert c.num_computed == shared and c.block_table == r.block_table[: shared // 4]
        allocator.free(r.block_table)
        assert allocator.num_free == 8 - shared // 4  # the choices hold the shared blocks
        assert choices.ready({"r": r}) == [] and choices.start(r) == []


def test_choices_wait_for_the_drafters_kv_and_fail_with_their_request() -> None:
    allocator = BlockAllocator(8)
    choices = Choices(allocator, 4, drafter_kv=True)
    r = _req("r", 9, n=2)
    choices.hold(r, source=True)
    assert choices.is_source("r")
    r.block_table = allocator.allocate(3)
    r.num_computed, r.num_draft_computed = 9, 3
    assert choices.ready({"r": r}) == []  # the drafter has not computed a whole block
    r.output_token_ids = [5, 6]  # a decode step has passed: start with what is shared
    assert choices.ready({"r": r}) == [r]
    (dropped,) = choices.drop("r")
    assert dropped.request_id == "r/1" and not choices.is_source("r")
    assert choices.ready({"r": r}) == []
