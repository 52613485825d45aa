"""How a load run is shown: a text table, a JSON document, and a PNG of latency distributions."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from bench.load_metrics import Outcome, RequestRecord, Stats, Summary


def _ms(s: Stats | None) -> str:
    if s is None:
        return f"{'-':>10}{'-':>10}{'-':>10}{0:>8}"
    return f"{1e3 * s.mean:>10.1f}{1e3 * s.p50:>10.1f}{1e3 * s.p99:>10.1f}{s.count:>8}"


def _opt(x: float | None, fmt: str) -> str:
    return "n/a (server reported no drafting)" if x is None else format(x, fmt)


def table(summary: Summary) -> str:
    """The run's summary as fixed-width text."""
    s = summary
    lines = [
        f"{'latency (ms)':<14}{'mean':>10}{'p50':>10}{'p99':>10}{'n':>8}",
        f"{'TTFT':<14}{_ms(s.ttft)}",
        f"{'TPOT':<14}{_ms(s.tpot)}",
        f"{'ITL':<14}{_ms(s.itl)}",
        f"{'E2E':<14}{_ms(s.e2e)}",
        "",
        f"requests: {s.completed} completed, {s.failed} failed, {s.cancelled} cancelled "
        f"of {s.num_sent} sent in {s.duration_s:.1f} s",
        f"errors by kind: {dict(s.errors) or 'none'}",
        f"request throughput: {s.request_throughput:.3f} req/s",
        f"output throughput:  {s.output_throughput:.2f} tok/s "
        f"({s.total_output_tokens} output, {s.total_prompt_tokens} prompt tokens)",
        f"acceptance rate:    {_opt(s.acceptance_rate, '.3f')}",
        f"accepted per step:  {_opt(s.mean_accepted_per_step, '.3f')}",
    ]
    return "\n".join(lines)


def report_json(
    summary: Summary, records: Sequence[RequestRecord], meta: Mapping[str, Any]
) -> dict[str, Any]:
    """The JSON document: run metadata, the summary, and every request's record."""
    rows = [
        asdict(r) | {"ttft_s": r.ttft_s, "tpot_s": r.tpot_s, "itl_s": list(r.itl_s)}
        for r in records
    ]
    return {"benchmark": "serve", **meta, "summary": asdict(summary), "requests": rows}


def write_json(path: Path, doc: Mapping[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=2))


def _cdf(ax: Any, values: Sequence[float], label: str) -> None:
    if values:
        xs = sorted(1e3 * v for v in values)
        ax.step(xs, [(i + 1) / len(xs) for i in range(len(xs))], where="post", label=label)


def plot(path: Path, records: Sequence[RequestRecord], title: str) -> None:
    """Latency CDFs, TTFT and TPOT histograms, and latency over the run, as one PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in records if r.outcome is Outcome.OK]
    ttft = [t for r in ok if (t := r.ttft_s) is not None]
    tpot = [t for r in ok if (t := r.tpot_s) is not None]
    fig, axes = plt.subplots(2, 2, figsize=(12, 8))
    ax = axes[0][0]
    _cdf(ax, ttft, "TTFT")
    _cdf(ax, tpot, "TPOT")
    _cdf(ax, [x for r in ok for x in r.itl_s], "ITL")
    _cdf(ax, [r.e2e_s for r in ok if r.e2e_s is not None], "E2E")
    ax.set(xscale="log", xlabel="ms", ylabel="fraction of requests (ITL: of gaps)")
    ax.set_title("latency CDFs")
    ax.legend()
    for ax, values, name in ((axes[0][1], ttft, "TTFT"), (axes[1][0], tpot, "TPOT")):
        ax.hist([1e3 * v for v in values], bins=30)
        ax.set(xlabel=f"{name} (ms)", ylabel="requests")
        ax.set_title(f"{name} histogram")
    ax = axes[1][1]
    for kind in sorted({r.kind for r in ok}):
        mine = [r for r in ok if r.kind == kind and r.e2e_s is not None]
        ax.scatter([r.start_s for r in mine], [r.e2e_s for r in mine], s=10, label=kind)
    ax.set(xlabel="sent at (s from start)", ylabel="E2E (s)")
    ax.set_title("E2E latency over the run")
    if ok:
        ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
