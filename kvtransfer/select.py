from __future__ import annotations

import logging
import time

import torch

from kvtransfer.fabric import Fabric
from kvtransfer.handoff import KVCompat, KVHandoff
from kvtransfer.pool import KVGroupSpec, KVPool, KVPoolSpec
from kvtransfer.transport import KVTransport, PullState

log = logging.getLogger(__name__)


def nixl_self_check(device: str, backend: str = "UCX") -> str | None:
    try:
        from kvtransfer.nixl_transport import NixlTransport

        spec = KVPoolSpec(2, 4, (KVGroupSpec("target", 1, 1, 8, "float32"),))
        a, b = KVPool(spec, device), KVPool(spec, device)
        a.tensor("target").normal_()
        src = NixlTransport(a, "check", backend=backend)
        dst = NixlTransport(b, "check", backend=backend)
        compat = KVCompat("check", "float32", 4, "check", 1, "none", "nixl")
        h = KVHandoff("self-check", src.sources(), (1,), ("target",), 4, 0, compat, 5.0)
        pull = dst.start_pull(h, [0])
        deadline = time.monotonic() + 5
        while (state := dst.poll(pull)) is PullState.PENDING and time.monotonic() < deadline:
            src.completed()
        dst.release(pull)
        src.close()
        dst.close()
        if state is not PullState.DONE:
            return f"loopback read ended {state.value}"
        if not torch.equal(a.tensor("target")[:, 1], b.tensor("target")[:, 0]):
            return "loopback read delivered wrong bytes"
        return None
    except Exception as e:
        return f"{type(e).__name__}: {e}"


def make_transport(
    choice: str,
    pool: KVPool,
    role: str,
    rank: int = 0,
    tp_size: int = 1,
    fabric: Fabric | None = None,
) -> tuple[KVTransport, str | None]:
    """``fabric``: resolved by the caller, its environment applied (default: plain UCX)."""
    if choice == "object_store":
        from kvtransfer.object_store_transport import ObjectStoreTransport

        return ObjectStoreTransport(pool, role), "configured: kv.transport=object_store"
    backend = fabric.backend if fabric is not None else "UCX"
    reason = nixl_self_check(str(pool.device), backend)
    if reason is None:
        from kvtransfer.nixl_transport import NixlTransport

        if fabric is not None:
            log.info("%s KV fabric: %s", role, fabric.describe())
        return NixlTransport(pool, role, rank=rank, tp_size=tp_size, backend=backend), None
    if choice == "nixl":
        raise RuntimeError(f"kv.transport=nixl but NIXL does not work here: {reason}")
    if tp_size > 1:
        raise RuntimeError(f"NIXL does not work here ({reason}) and the fallback needs TP = 1")
    log.error(
        "kv.transport=auto FELL BACK: NIXL does not work on this %s worker (%s). Its KV moves "
        "through Ray's object store, and a NIXL peer refuses its handoffs. Shown in /health "
        "(fallback_replicas) and the tandem_kv_transport_fallback metric; set kv.transport=nixl "
        "to fail start-up instead.",
        role,
        reason,
    )
    from kvtransfer.object_store_transport import ObjectStoreTransport

    return ObjectStoreTransport(pool, role), f"NIXL unavailable: {reason}"
