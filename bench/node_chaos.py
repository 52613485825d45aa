"""Losing a node of a real multi-node Ray cluster on this machine, mid-traffic.

``PoolCluster`` starts a head node (Serve controller, HTTP proxy, ingress) and one Ray node per
pool replica as separate raylet processes (``ray.cluster_utils.Cluster``), each advertising its
pool's custom resource, and deploys the app across them. ``run_fault`` sends traffic, kills a
node outright (its raylet and every worker on it: what a lost VM looks like to Ray), and reports
what happened: requests affected (cut, errored or retried), those answered with a clear error,
wrong outputs (greedy texts against a run before the fault: must be 0), requests that neither
finished nor failed cleanly (must be 0), how long until a new request succeeds, KV blocks and
prefill leases still held once traffic has drained (must be 0), and, after the node returns,
how long until the pool has all its replicas again.

    python -m bench.node_chaos --out bench/results/node_chaos.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx
import ray
from ray import serve
from ray.cluster_utils import Cluster

from cluster.builder import build_app
from cluster.config import TandemConfig

HEAD_RESOURCE = "tandem_head"  # pins the ingress next to the HTTP proxy
DOWN_S = 2.0  # how long a pool's only node stays away before it returns


@dataclass(frozen=True)
class FaultReport:
    kind: str  # "decode_node" (killed mid-stream) or "prefill_node" (killed mid-handoff)
    requests: int
    on_killed_node: int  # requests /health showed on the killed node as it was killed
    finished: int  # answered in full
    affected: int  # cut with an error, answered only after a retry, or its prompt recomputed
    retried: int  # sent again by the ingress (limits.retries)
    recomputed: int  # handoffs decode could not pull, their prompts computed on decode
    clear_errors: int  # ended with an explained error (an SSE error event, or a 503 body)
    wrong_outputs: int  # finished, but not with the text of the undisturbed run
    unexplained: int  # neither finished nor failed cleanly (hung, dropped connection)
    recover_s: float  # from the kill to the first new request that succeeds
    leaked_blocks: int  # KV blocks held on decode or prefill once traffic drained
    leaked_leases: int
    replicas_back_s: float | None  # from the node's return to the pool's full replica count
    on_dead_node: int  # replicas /health still places on the killed node afterwards (0)


class PoolCluster:
    """A head and one node per pool replica, each its own raylet on this machine."""

    def __init__(self, cfg: TandemConfig) -> None:
        self.cfg = cfg
        self.cluster = Cluster(
            initialize_head=True,
            head_node_args={"num_cpus": 1, "resources": {HEAD_RESOURCE: 1.0}},
        )
        self.nodes: dict[str, list[Any]] = {"prefill": [], "decode": []}
        for pool in ("prefill", "decode"):
            for _ in range(self._pool(pool).most_replicas()):
                self.restore(pool)
        ray.init(address=self.cluster.address)

    def _pool(self, pool: str) -> Any:
        return self.cfg.prefill if pool == "prefill" else self.cfg.decode

    def restore(self, pool: str) -> None:
        """Add a node of ``pool`` (one replica's worth of its resource)."""
        p = self._pool(pool)
        node = self.cluster.add_node(num_cpus=1, resources={p.resource: float(p.tp)})
        self.nodes[pool].append(node)

    def kill(self, pool: str, node_id: str | None = None) -> str:
        """Kill a node of the pool (``node_id``'s, else the first): its raylet and every
        worker process on it; its id."""
        nodes = self.nodes[pool]
        node = next((n for n in nodes if n.node_id == node_id), nodes[0])
        nodes.remove(node)
        self.cluster.remove_node(node, allow_graceful=False)
        return str(node.node_id)

    def deploy(self, port: int) -> str:
        serve.start(proxy_location="HeadOnly", http_options={"host": "127.0.0.1", "port": port})
        serve.run(build_app(self.cfg), name="tandem", route_prefix="/")
        return f"http://127.0.0.1:{port}"

    def close(self) -> None:
        try:
            serve.shutdown()
        finally:
            ray.shutdown()
            self.cluster.shutdown()


def chaos_config(model: str, name: str, base: dict[str, Any] | None = None) -> TandemConfig:
    """Two decode replicas (one per decode node), one prefill replica, greedy drafting by
    n-gram lookup, short leases so that what a dead replica never pulled comes back soon."""
    cfg = {
        "mode": "disaggregated",
        "model": {"source": model, "name": name},
        "draft": {"kind": "ngram"},
        "prefill": {"replicas": 1, "num_blocks": 256, "num_threads": 1, "lease_seconds": 10},
        "decode": {"replicas": 2, "num_blocks": 512, "num_threads": 1, "max_batch_size": 4},
        "kv": {"pull_timeout_s": 3},
        "http": {"ingress_resource": HEAD_RESOURCE},
        "auth": {"required": False},  # a cluster on loopback, for the run only
    }
    return TandemConfig.model_validate({**cfg, **(base or {})})


def _prompt(i: int, length: int) -> list[int]:
    return [(7 * i + j) % 900 + 20 for j in range(length)]


async def _one(
    client: httpx.AsyncClient, model: str, prompt: list[int], max_tokens: int, progress: list[int]
) -> tuple[str, str]:
    """Stream one greedy completion: (outcome, text); outcome is ``ok``, ``error`` (an
    explained failure: an SSE error event or an error status with a body) or ``unexplained``."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    text = []
    try:
        async with client.stream("POST", "/v1/completions", json=body | {"stream": True}) as r:
            if r.status_code != 200:
                await r.aread()
                return ("error" if "error" in r.json() else "unexplained"), ""
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line.removeprefix("data: "))
                if "error" in event:
                    return "error", ""
                text.append(event["choices"][0]["text"])
                progress.append(1)
                if event["choices"][0]["finish_reason"] is not None:
                    return "ok", "".join(text)
    except (httpx.HTTPError, json.JSONDecodeError):
        return "unexplained", ""
    return "unexplained", ""


async def _traffic(
    base: str, model: str, prompts: list[list[int]], max_tokens: int, progress: list[int]
) -> list[tuple[str, str]]:
    async with httpx.AsyncClient(base_url=base, timeout=180) as client:
        return list(
            await asyncio.gather(*(_one(client, model, p, max_tokens, progress) for p in prompts))
        )


def _health(base: str) -> dict[str, Any]:
    body: dict[str, Any] = httpx.get(f"{base}/health", timeout=30).json()
    return body


def _busiest_node(base: str, pool: str, want: int, limit_s: float = 5) -> tuple[str | None, int]:
    """The node of ``pool``'s replica with the most requests (decode: running, waiting or
    pulling; prefill: queued or leased), the one whose loss affects the most streams, and
    that count. The board is read until it shows ``want`` requests in the pool (it lags the
    traffic by up to a publish period; a stale board made the pick blind), for at most
    ``limit_s``; (None, 0) if it cannot say."""

    def load(r: dict[str, Any]) -> int:
        keys = ("running", "waiting", "pulling", "queued", "active_leases")
        return int(sum(r.get(k, 0) for k in keys))

    deadline = time.monotonic() + limit_s
    best: tuple[str | None, int] = (None, 0)
    while True:
        pools = _replicas(base)
        if pools and pools[pool]:
            top = max(pools[pool], key=load)
            best = (top.get("node_id"), load(top))
            if sum(load(r) for r in pools[pool]) >= want:
                return best
        if time.monotonic() > deadline:
            return best
        time.sleep(0.1)


def _retries(base: str) -> int:
    """Requests the ingress has sent again, from ``/health`` (asked again while it answers
    without them, e.g. a 503 as a pool recovers)."""
    for _ in range(60):
        body = _health(base)
        if "retries" in body:
            return int(sum(body["retries"].values()))
        time.sleep(1)
    raise RuntimeError(f"/health did not report retries: {body}")


def _recomputed(base: str) -> int:
    """Prompts the live decode replicas computed after a failed pull, from ``/health``."""
    body = _health(base)
    return int(body.get("pools", {}).get("decode", {}).get("kv_recomputed", 0))


def _first_success_s(base: str, model: str, since: float, limit_s: float = 120) -> float:
    """Seconds from ``since`` until a new short request succeeds (``limit_s`` if none does)."""
    body = {"model": model, "prompt": _prompt(999, 8), "max_tokens": 4, "temperature": 0}
    while time.monotonic() - since < limit_s:
        try:
            if httpx.post(f"{base}/v1/completions", json=body, timeout=30).status_code == 200:
                return time.monotonic() - since
        except httpx.HTTPError:
            pass
        time.sleep(0.25)
    return limit_s


def _leaks(base: str, within_s: float) -> tuple[int, int]:
    """(KV blocks, prefill leases) still held by live replicas once traffic drained, waiting
    up to ``within_s`` (a lease a dead decode replica never pulled ends by expiry)."""
    deadline = time.monotonic() + within_s
    blocks = leases = -1  # unknown until both pools' boards answer
    while time.monotonic() < deadline:
        pools = _replicas(base)
        if pools is not None:
            live = [r for rs in pools.values() for r in rs if r.get("age_s", 0) < 5]
            blocks = sum(r.get("num_blocks", 0) - r.get("free_blocks", 0) for r in live)
            leases = sum(r.get("active_leases", 0) for r in live)
            if blocks == 0 and leases == 0:
                break
        time.sleep(1)
    return blocks, leases


def _replicas(base: str) -> dict[str, list[dict[str, Any]]] | None:
    """Each pool's replica entries from ``/health``, or None while a board is unavailable."""
    try:
        pools = _health(base).get("pools", {})
    except (httpx.HTTPError, ValueError):
        return None
    if any("replicas" not in pools.get(p, {}) for p in ("prefill", "decode")):
        return None
    return {p: list(pools[p]["replicas"].values()) for p in ("prefill", "decode")}


def _replicas_back_s(base: str, pool: str, want: int, since: float, limit_s: float) -> float | None:
    while time.monotonic() - since < limit_s:
        pools = _replicas(base)
        if pools is not None and sum(r["age_s"] < 3 for r in pools[pool]) == want:
            return time.monotonic() - since
        time.sleep(0.5)
    return None


def run_fault(
    pc: PoolCluster, base: str, model: str, kind: str, n: int = 6, max_tokens: int = 48
) -> FaultReport:
    """Traffic of ``n`` greedy streams, a node of ``kind``'s pool killed once they are under
    way (decode: mid-stream, the busiest replica's node; prefill: with prompts queued and
    handoffs in flight). A pool with
    another replica (decode) serves on; the node returns once the app has recovered. A pool
    left with none (the one prefill node) gets its node back ``DOWN_S`` after the kill, as a
    replaced VM would. See ``FaultReport``."""
    pool = "decode" if kind == "decode_node" else "prefill"
    want_replicas = pc._pool(pool).most_replicas()
    length = 16 if pool == "decode" else 300
    prompts = [_prompt(i + (100 if pool == "prefill" else 0), length) for i in range(n)]
    want = asyncio.run(_traffic(base, model, prompts, max_tokens, []))
    retried_before, recomputed_before = _retries(base), _recomputed(base)

    async def faulted() -> tuple[list[tuple[str, str]], float, float | None, str, int]:
        progress: list[int] = []
        task = asyncio.create_task(_traffic(base, model, prompts, max_tokens, progress))
        # decode: every stream has decoded a few tokens; prefill: the first prompt is done
        # (or the traffic ended without: refused, say; the fault then lands on an idle pool)
        while len(progress) < (4 * n if pool == "decode" else 1) and not task.done():
            await asyncio.sleep(0.02)
        loop = asyncio.get_running_loop()
        killed = time.monotonic()
        # decode: every stream the pool takes at once (the rest wait at the ingress)
        held = min(n, want_replicas * pc._pool(pool).max_ongoing_requests)
        node, on_node = await loop.run_in_executor(
            None, _busiest_node, base, pool, held if pool == "decode" else 1
        )
        dead = await loop.run_in_executor(None, pc.kill, pool, node)
        returned = None
        if want_replicas == 1:
            await asyncio.sleep(DOWN_S)
            pc.restore(pool)  # in the main thread (a raylet sets signal handlers); the
            returned = time.monotonic()  # loop waits the seconds it takes
        return await task, killed, returned, dead, on_node

    got, killed, returned, dead, on_node = asyncio.run(faulted())
    recover_s = _first_success_s(base, model, killed)
    retried = _retries(base) - retried_before
    # a replica lost with the node takes its count along: never below zero
    recomputed = max(0, _recomputed(base) - recomputed_before)
    blocks, leases = _leaks(base, within_s=30)
    if returned is None:
        returned = time.monotonic()
        pc.restore(pool)
    back = _replicas_back_s(base, pool, want_replicas, returned, limit_s=180)
    pools = _replicas(base) or {}
    # live entries only: the dead replica's last entry lingers on the board until it is stale
    on_dead = sum(r.get("node_id") == dead and r["age_s"] < 3 for rs in pools.values() for r in rs)

    outcomes = [o for o, _ in got]
    wrong = sum(o == "ok" and t != w for (o, t), (_, w) in zip(got, want, strict=True))
    errors = outcomes.count("error")
    return FaultReport(
        kind=kind,
        requests=n,
        on_killed_node=on_node,
        finished=outcomes.count("ok"),
        affected=errors + outcomes.count("unexplained") + retried + recomputed,
        retried=retried,
        recomputed=recomputed,
        clear_errors=errors,
        wrong_outputs=wrong,
        unexplained=outcomes.count("unexplained"),
        recover_s=round(recover_s, 2),
        leaked_blocks=blocks,
        leaked_leases=leases,
        replicas_back_s=None if back is None else round(back, 2),
        on_dead_node=on_dead,
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="embedded", help="model source (default: the embedded one)")
    ap.add_argument("--streams", type=int, default=6)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--port", type=int, default=8010)
    ap.add_argument("--out", type=Path, default=Path("bench/results/node_chaos.json"))
    args = ap.parse_args()
    cfg = chaos_config(args.model, "m")
    pc = PoolCluster(cfg)
    try:
        t0 = time.monotonic()
        base = pc.deploy(args.port)
        deployed_s = time.monotonic() - t0
        reports = [
            run_fault(pc, base, "m", kind, args.streams, args.max_tokens)
            for kind in ("decode_node", "prefill_node")
        ]
    finally:
        pc.close()
    out = {
        "nodes": {"head": 1, "prefill": 1, "decode": 2},
        "model": args.model,
        "deploy_s": round(deployed_s, 1),
        "faults": [asdict(r) for r in reports],
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=2) + "\n")
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
