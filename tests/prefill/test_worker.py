"""The prefill worker: chunked prefill, several prompts per forward, prefix caching, cancel."""

from __future__ import annotations

import gc
import time
import weakref
from pathlib import Path

import pytest
import torch

from decode.config import DecodeEngineConfig
from decode.engine import DecodeEngine
from kvtransfer.handoff import KVHandoff
from models.eagle import save_random_eagle
from models.request import Request
from models.sampling import SamplingParams
from models.spec import DraftKind, DraftSpec, ModelSpec
from prefill.config import PrefillWorkerConfig
from prefill.worker import PrefillCapacityError, PrefillWorker
from tests.decode.engine_utils import make_request, run_all

SP = SamplingParams(temperature=0.0, max_tokens=8)


@pytest.fixture(scope="module")
def specs(tiny_folder: Path, tiny_draft_folder: Path) -> tuple[ModelSpec, DraftSpec]:
    draft = DraftSpec(DraftKind.DRAFT_MODEL, model=ModelSpec(str(tiny_draft_folder)))
    return ModelSpec(str(tiny_folder)), draft


def _worker(specs: tuple[ModelSpec, DraftSpec], **kw: object) -> PrefillWorker:
    target, draft = specs
    return PrefillWorker(PrefillWorkerConfig("t", target, draft, **kw))  # type: ignore[arg-type]


def _kv(w: PrefillWorker, h: KVHandoff, n: int) -> dict[str, torch.Tensor]:
    """The KV of the first n tokens, gathered from the handoff's blocks."""
    out = {}
    for g, t in w.pool.tensors.items():
        blocks = t[:, list(h.block_ids)]  # [L, nb, 2, H, bs, D]
        per_token = blocks.permute(1, 4, 0, 2, 3, 5)  # [nb, bs, L, 2, H, D]
        out[g] = per_token.reshape(-1, *per_token.shape[2:])[:n]
    return out


def _prompt(n: int, seed: int) -> list[int]:
    return torch.randint(3, 49152, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_chunked_prefill_equals_one_forward(specs: tuple[ModelSpec, DraftSpec]) -> None:
    prompt = _prompt(70, 1)
    whole = _worker(specs, max_num_batched_tokens=4096)
    chunked = _worker(specs, max_num_batched_tokens=9)
    h1, h2 = whole.prefill(make_request(prompt, SP)), chunked.prefill(make_request(prompt, SP))
    assert h1.first_token == h2.first_token
    assert h1.acceptance_probe == pytest.approx(h2.acceptance_probe, abs=1e-5)
    kv1, kv2 = _kv(whole, h1, 70), _kv(chunked, h2, 70)
    for g in kv1:
        assert (kv1[g] - kv2[g]).abs().max() <= 1e-5
    assert chunked.stats().prompt_tokens_computed == 70


def test_several_prompts_share_one_forward(specs: tuple[ModelSpec, DraftSpec]) -> None:
    w = _worker(specs, max_num_batched_tokens=100)
    got: list[KVHandoff | BaseException] = []
    for i, n in enumerate((30, 25, 20, 40)):
        w.submit(make_request(_prompt(n, 10 + i), SP), got.append)
    w.step()  # 100 tokens of budget: the first three prompts (75) and 25 tokens of the fourth
    assert len(got) == 3 and all(isinstance(h, KVHandoff) for h in got)
    assert w.stats().queued == 1
    w.step()
    assert len(got) == 4


def test_prefix_cache_skips_shared_blocks_and_gives_the_same_kv(
    specs: tuple[ModelSpec, DraftSpec],
) -> None:
    shared = _prompt(40, 20)
    a, b = shared + _prompt(9, 21), shared + _prompt(13, 22)
    w = _worker(specs)
    w.prefill(make_request(a, SP))
    hb = w.prefill(make_request(b, SP))
    s = w.stats()
    assert s.prompt_tokens_cached == 32  # two full blocks of 16 shared
    assert s.prompt_tokens_computed == len(a) + len(b) - 32
    fresh = _worker(specs, enable_prefix_caching=False)
    hf = fresh.prefill(make_request(b, SP))
    assert hb.first_token == hf.first_token
    kv_b, kv_f = _kv(w, hb, len(b)), _kv(fresh, hf, len(b))
    for g in kv_b:
        assert (kv_b[g] - kv_f[g]).abs().max() <= 1e-5
    w.reap(now=time.monotonic() + hb.lease_seconds + w.cfg.lease_grace_s + 1)
    w.allocator.check()
    assert w.stats().free_blocks == w.cfg.num_blocks and w.stats().cached_blocks >= 2


@pytest.fixture(scope="module")
def eagle_specs(
    tiny_folder: Path, tmp_path_factory: pytest.TempPathFactory
) -> tuple[ModelSpec, DraftSpec]:
    head = save_random_eagle(tiny_folder, tmp_path_factory.mktemp("eagle"))
    draft = DraftSpec(DraftKind.EAGLE, model=ModelSpec(str(head)), num_speculative_tokens=3)
    return ModelSpec(str(tiny_folder)), draft


def test_eagle_prefix_hits_give_the_kv_and_the_output_of_a_cold_cache(
    eagle_specs: tuple[ModelSpec, DraftSpec],
) -> None:
    """The head's slot t is computed from token t + 1, so a cached block is only reused where
    the token after it matches too, and a prompt's last full block (its last head slot never
    written) is not cached at all: a prompt that diverges right after a cached block, or
    extends a prompt that ended on one, gets the draft KV and the seeded output it would get
    with the cache cold."""
    target, draft = eagle_specs
    base = _prompt(48, 40)
    seeded = SamplingParams(temperature=1.0, max_tokens=10, seed=5, seeded=True)
    for first, second in (
        (base, base[:32] + _prompt(11, 41)),  # diverges at the start of block 2
        (base[:32], base[:32] + _prompt(11, 42)),  # the first ended on a full block
    ):
        warm = _worker(eagle_specs)
        warm.prefill(make_request(first, SP))
        cold = _worker(eagle_specs, enable_prefix_caching=False)
        hw = warm.prefill(make_request(second, seeded))
        hc = cold.prefill(make_request(second, seeded))
        assert hw.first_token == hc.first_token
        kw, kc = _kv(warm, hw, len(second) - 1), _kv(cold, hc, len(second) - 1)
        for g in kw:  # the head's last slot waits for the first output token
            assert (kw[g] - kc[g]).abs().max() <= 1e-5, g
        outs = []
        for w in (warm, cold):
            engine = DecodeEngine(DecodeEngineConfig("t", target, draft, num_blocks=64))
            r = make_request(second, seeded)
            outs.append(run_all(engine, [r], prefill=w)[r.request_id])
            engine.close()
        assert outs[0] == outs[1]


def test_cancel_frees_queued_and_leased_blocks(specs: tuple[ModelSpec, DraftSpec]) -> None:
    w = _worker(specs, max_num_batched_tokens=8)
    got: list[KVHandoff | BaseException] = []
    queued = make_request(_prompt(50, 30), SP)
    w.submit(queued, got.append)
    w.step()  # admitted, partly computed
    w.cancel(queued.request_id)
    w.step()
    assert not got and w.stats().free_blocks == w.cfg.num_blocks
    leased = w.prefill(make_request(_prompt(20, 31), SP))
    assert w.stats().active_leases == 1
    w.cancel(leased.request_id)
    w.step()
    assert w.stats().active_leases == 0 and w.stats().free_blocks == w.cfg.num_blocks


def test_a_worker_dropped_with_a_lease_open_stops_its_progress_thread(
    specs: tuple[ModelSpec, DraftSpec],
) -> None:
    """Nobody called close(): the worker, its pool and its NIXL agent are still released, and
    its progress thread (polling every 0.2 ms while a lease is open) ends with it."""
    w = _worker(specs)
    w.prefill(make_request(_prompt(20, 32), SP))  # leased, never pulled
    assert w.stats().active_leases == 1
    thread, ref = w._progress, weakref.ref(w)
    assert thread.is_alive()
    del w
    gc.collect()
    thread.join(timeout=5)
    assert ref() is None and not thread.is_alive()


def test_prompt_larger_than_the_pool_is_refused(specs: tuple[ModelSpec, DraftSpec]) -> None:
    w = _worker(specs, num_blocks=2)
    with pytest.raises(PrefillCapacityError, match="exceeds the prefill KV pool"):
        w.prefill(Request("big", _prompt(40, 40), SP))
    assert w.stats().free_blocks == 2


def test_an_idle_worker_gives_freed_heap_back_once_per_forwards_run(
    specs: tuple[ModelSpec, DraftSpec],
) -> None:
    w = _worker(specs)
    assert w.release_memory() is None  # nothing has run since start-up
    w.prefill(make_request(_prompt(50, 40), SP))
    released = w.release_memory()
    assert released is not None and released >= 0  # glibc here: malloc_trim exists
    assert w.release_memory() is None  # no forward since: nothing to give back
    s = w.stats()
    assert s.heap_releases == 1 and s.heap_released_bytes == released


def test_a_failure_while_handing_over_settles_the_caller(
    specs: tuple[ModelSpec, DraftSpec],
) -> None:
    """A second prompt under a request id that still holds a lease fails at ``leases.add``,
    after the prompt's forward: before, its caller's future never settled (a hung client)."""
    w = _worker(specs, num_blocks=32, enable_prefix_caching=False)
    first = make_request(list(range(3, 40)), SP)
    held = w.prefill(first)
    twin = Request(first.request_id, list(range(50, 90)), SP)
    got: list[KVHandoff | BaseException] = []
    w.submit(twin, got.append)
    for _ in range(20):
        w.step()
        if got:
            break
    [error] = got
    assert isinstance(error, ValueError) and "already holds a lease" in str(error)
    assert w.stats().free_blocks == 32 - len(held.block_ids)  # the twin's blocks came back
    assert w.stats().active_leases == 1  # the first lease is untouched


def test_prefix_caches_are_per_tenant(specs: tuple[ModelSpec, DraftSpec]) -> None:
    """Requests of one API key reuse its cached prompt blocks; another key's requests never
    do (the time to a first token would tell it the prompt was sent)."""
    w = _worker(specs, num_blocks=32)
    prompt = list(range(3, 60))  # three full blocks of 16 and a tail
    for salt, cached in (("key-a", 0), ("key-a", 48), ("key-b", 0), ("", 0), ("", 48)):
        before = w.stats().prompt_tokens_cached
        r = make_request(prompt, SP)
        r.cache_salt = salt
        w.prefill(r)
        w.cancel(r.request_id)  # the lease ends; the blocks stay cached
        w.step()
        assert w.stats().prompt_tokens_cached - before == cached, salt
