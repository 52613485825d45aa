"""Serving load client: replays ShareGPT or a synthetic mix against an OpenAI-compatible server.

Streams every request, with Poisson arrivals (``--request-rate``) or a fixed number in flight
(``--concurrency``, or both: Poisson with a cap), bounded by ``--num-requests`` and
``--max-seconds``. Prints TTFT, TPOT, ITL and E2E latency (mean, p50, p99), request and output
token throughput, and the speculative acceptance the server reports; writes JSON and a PNG to
``bench/results/serve-<label>.{json,png}``. ``--launch`` starts a local tandem cluster first.

    .venv/bin/python -m bench.serve --base-url http://127.0.0.1:8000/v1 --concurrency 8
    .venv/bin/python -m bench.serve --launch disaggregated --draft ngram --dataset sharegpt \
        --num-requests 32 --concurrency 4 --max-tokens 64
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import platform
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import httpx
import yaml

from bench.load_client import Arrivals, LoadResult, Target, fetch_model_id, run_load, send_streamed
from bench.load_metrics import Outcome, RequestRecord, Summary, stats, summarize
from bench.load_report import plot, report_json, table, write_json
from bench.router_metrics import router_view, wait_for
from bench.sharegpt import iter_conversations
from bench.workloads import WorkItem, bimodal_items, sharegpt_items, synthetic_items
from runtime.ports import free_port

RESULTS = Path(__file__).parent / "results"


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add = ap.add_argument
    add("--base-url", default="http://127.0.0.1:8000/v1", help="OpenAI API root (ends in /v1)")
    add("--model", help="model id to send; default: the first one GET /v1/models lists")
    add("--endpoint", choices=("chat", "completions"), default="chat")
    add("--dataset", choices=("sharegpt", "synthetic", "bimodal"), default="sharegpt")
    add("--num-requests", type=int, default=100, help="requests in the workload")
    add("--max-seconds", type=float, help="stop sending and cancel what is in flight after this")
    add("--request-rate", type=float, help="Poisson arrivals per second ('inf': all at once)")
    add("--concurrency", type=int, help="requests in flight at most (default 1 without a rate)")
    add("--max-tokens", type=int, help="cap on every request's max_tokens")
    add("--max-prompt-tokens", type=int, default=1024, help="ShareGPT: longest prompt (approx.)")
    add("--input-len", type=int, default=256, help="synthetic: prompt tokens (approx.)")
    add("--output-len", type=int, default=128, help="synthetic: max_tokens")
    add("--range-ratio", type=float, default=0.0, help="synthetic: lengths vary by ± this ratio")
    add("--copy-fraction", type=float, default=0.0, help="synthetic: share of copy-heavy prompts")
    add("--temperature", type=float, default=0.0, help="0 is greedy")
    add("--seed", type=int, default=0, help="workload sampling, arrivals, request seeds")
    add("--request-timeout", type=float, default=600.0, help="seconds per request")
    add("--warmup", type=int, default=1, help="untimed requests sent first")
    add("--label", help="names the outputs; default from launch, dataset and arrivals")
    add("--out", type=Path, help="JSON path; default bench/results/serve-<label>.json")
    add(
        "--metrics-port",
        type=int,
        help="Ray's Prometheus port on the ingress's node: the run records the decode router's "
        "metrics (with --launch: the launched cluster's, by default)",
    )
    add("--launch", choices=("none", "disaggregated", "colocated"), default="none")
    add("--draft", choices=("none", "ngram"), help="with --launch; default ngram, or --config's")
    add("--decode-max-batch", type=int, help="with --launch: decode.max_batch_size")
    add("--decode-replicas", type=int, help="with --launch: decode.replicas")
    add("--routing", help="with --launch: decode.routing (e.g. acceptance_aware, power_of_two)")
    add("--config", type=Path, help="with --launch: base TandemConfig YAML")
    add(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="with --launch: a config field by dotted path, value as YAML "
        "(e.g. decode.speculation_tpot_slo_s=0.09); repeatable",
    )
    args = ap.parse_args(argv)
    if args.request_rate is None and args.concurrency is None:
        args.concurrency = 1
    if args.draft is None and args.config is None:
        args.draft = "ngram"
    return args


def default_label(args: argparse.Namespace) -> str:
    parts = [args.launch] if args.launch != "none" else []
    if args.launch != "none" and args.draft is not None:
        parts.append(args.draft)
    if args.launch != "none" and args.routing is not None:
        parts.append(args.routing)
    parts.append(args.dataset)
    if args.request_rate is not None:
        parts.append(f"r{args.request_rate:g}")
    if args.concurrency is not None:
        parts.append(f"c{args.concurrency}")
    return "-".join(parts)


def workload(args: argparse.Namespace) -> list[WorkItem]:
    if args.dataset == "sharegpt":
        return sharegpt_items(
            iter_conversations(),
            args.num_requests,
            args.seed,
            max_tokens_cap=args.max_tokens,
            max_prompt_tokens=args.max_prompt_tokens,
        )
    out_len = min(args.output_len, args.max_tokens or args.output_len)
    if args.dataset == "bimodal":
        return bimodal_items(args.num_requests, out_len, args.seed)
    return synthetic_items(
        args.num_requests, args.input_len, out_len, args.range_ratio, args.copy_fraction, args.seed
    )


def parse_sets(items: Sequence[str]) -> dict[str, object]:
    """``--set KEY=VALUE`` pairs as config overrides (each value parsed as YAML)."""
    out: dict[str, object] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise SystemExit(f"--set takes KEY=VALUE (a dotted config path), got {item!r}")
        out[key] = yaml.safe_load(value)
    return out


def _ray_metrics_port() -> int:
    """The Prometheus port of the Ray node this process started."""
    import ray

    return int(ray.nodes()[0]["MetricsExportPort"])


@contextlib.contextmanager
def launched(args: argparse.Namespace) -> Iterator[tuple[str, dict[str, Any]]]:
    """A local tandem cluster for the run: (its /v1 base URL, its configuration)."""
    from bench.local_app import local_app
    from cluster.config import TandemConfig

    cpus = os.cpu_count() or 1
    base = TandemConfig.from_yaml(args.config) if args.config else TandemConfig()
    overrides: dict[str, object] = {
        "mode": args.launch,
        "http.port": free_port(),  # never collide with a server already on the config's port
    }
    if args.draft is not None:
        overrides["draft.kind"] = args.draft
    if not args.config:
        overrides |= {"prefill.num_threads": cpus, "decode.num_threads": cpus}
    if args.decode_max_batch is not None:
        overrides["decode.max_batch_size"] = args.decode_max_batch
    if args.decode_replicas is not None:
        overrides["decode.replicas"] = args.decode_replicas
    if args.routing is not None:
        overrides["decode.routing"] = args.routing
    overrides |= parse_sets(args.set)
    cfg = base.with_overrides(**overrides)
    with local_app(cfg, num_cpus=cpus) as base_url:
        yield base_url, cfg.model_dump(mode="json")


def decode_router_view(port: int | None, requests: int) -> dict[str, Any] | None:
    """The decode router's metrics from Ray's Prometheus ``port`` (None: not recorded), once
    ``requests`` placements are exported."""
    return None if port is None else router_view(wait_for(port, "decode", requests))


async def drive(
    args: argparse.Namespace, base_url: str, items: Sequence[WorkItem]
) -> tuple[str, LoadResult]:
    """Warm the server up, then send the workload. Returns (model id, what was measured)."""
    timeout = httpx.Timeout(args.request_timeout, connect=30.0)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(base_url=base_url, timeout=timeout, limits=limits) as client:
        model = args.model or await fetch_model_id(client)
        target = Target(model, args.endpoint, args.temperature, args.seed)
        for i in range(args.warmup):
            warm = await send_streamed(client, target, -1, WorkItem("warmup", "Hello!", 8), 0.0)
            print(f"warm-up {i}: {warm.outcome.value} {warm.error or ''}", flush=True)
            if warm.outcome is not Outcome.OK:  # the server refuses a plain request: no run
                raise RuntimeError(f"warm-up request failed: {warm.error}")

        async def send_one(index: int, item: WorkItem, run_start: float) -> RequestRecord:
            return await send_streamed(client, target, index, item, run_start)

        arrivals = Arrivals(args.request_rate, args.concurrency)
        result = await run_load(items, send_one, arrivals, args.max_seconds, args.seed)
    return model, result


async def main(argv: Sequence[str] | None = None) -> Path:
    """Run the benchmark the arguments describe; returns the JSON path it wrote."""
    args = parse_args(argv)
    label = args.label or default_label(args)
    out: Path = args.out or RESULTS / f"serve-{label}.json"
    items = workload(args)
    print(f"{label}: {len(items)} {args.dataset} requests -> {args.endpoint}", flush=True)
    launch_cfg: dict[str, Any] | None = None
    with contextlib.ExitStack() as stack:
        base_url, metrics_port = args.base_url, args.metrics_port
        if args.launch != "none":
            base_url, launch_cfg = stack.enter_context(launched(args))
            metrics_port = args.metrics_port or _ray_metrics_port()
        model, result = await drive(args, base_url, items)
        router = decode_router_view(metrics_port, len(items) + args.warmup)
    summary: Summary = summarize(result.records, result.duration_s)
    ok = [r for r in result.records if r.outcome is Outcome.OK]
    print(table(summary), flush=True)
    meta = {
        "label": label,
        "base_url": base_url,
        "model": model,
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "launch_config": launch_cfg,
        "router": router,  # the decode router's own metrics (launched runs)
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
        "finished_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "tpot_by_kind": {
            kind: asdict(st)
            if (st := stats([t for r in ok if r.kind == kind and (t := r.tpot_s)]))
            else None
            for kind in sorted({r.kind for r in ok})
        },
    }
    write_json(out, report_json(summary, result.records, meta))
    plot(out.with_suffix(".png"), result.records, f"{label} ({model})")
    print(f"wrote {out} and {out.with_suffix('.png')}", flush=True)
    return out


if __name__ == "__main__":
    asyncio.run(main())
