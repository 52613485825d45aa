"""The ``tandem`` command line.

``serve`` and ``config`` are built in; other packages add subcommands through the
``tandem.commands`` entry-point group (``distill`` does: ``tandem distill``), so this serving
package never imports them.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading
import time
from importlib.metadata import entry_points
from typing import Any

import yaml
from pydantic import ValidationError

from cluster.auth import load_keys
from cluster.config import TandemConfig
from cluster.model_config import DTYPE_HELP, QUANTIZATION_HELP

log = logging.getLogger("tandem")
COMMANDS_GROUP = "tandem.commands"  # entry points: callables taking the subparsers object


def _setting(text: str) -> tuple[str, Any]:
    """``--set key=value``: a dotted config field and a YAML value (``8``, ``true``, ``null``)."""
    key, sep, value = text.partition("=")
    if not sep or not key.strip():
        raise argparse.ArgumentTypeError(
            f"--set wants key=value (e.g. decode.num_blocks=4096), got {text!r}"
        )
    return key.strip(), yaml.safe_load(value)


def _load_config(args: argparse.Namespace) -> TandemConfig:
    """The YAML config (or the defaults), then the flags, then ``--set``: validated as one."""
    cfg = TandemConfig.from_yaml(args.config) if args.config else TandemConfig()
    flags = {
        "model.source": args.model,
        "model.dtype": args.dtype,
        "model.quantization": args.quantization,
        "mode": args.mode,
        "http.host": args.host,
        "http.port": args.port,
        "limits.max_model_len": args.max_model_len,
        "decode.tp": args.tp,
        "prefill.tp": args.tp,
        "draft.source": args.draft_source,
    }
    overrides: dict[str, Any] = {k: v for k, v in flags.items() if v is not None}
    if args.draft:
        overrides["draft.kind"] = args.draft
        if args.draft in ("none", "ngram"):  # no checkpoint: drop the config's head, if any
            overrides["draft.source"] = None
            overrides["draft.lookup_first"] = False
        if args.draft != "eagle":  # trees are drafted by an EAGLE head only
            overrides["draft.tree_width"] = 1
    overrides.update(args.set or [])
    return cfg.with_overrides(**overrides) if overrides else cfg


def serve_cmd(args: argparse.Namespace) -> int:
    from ray import serve

    from cluster.builder import build_app
    from cluster.local_cluster import shutdown, start_ray, start_serve

    try:
        cfg = _load_config(args)
    except (ValidationError, ValueError) as e:  # a field named, and what it must be
        print(f"tandem serve: invalid configuration: {e}", file=sys.stderr)
        return 2
    if not load_keys(cfg.auth).enabled:  # only with auth.required: false (else no start)
        log.warning(
            "serving on %s with no API key set (auth.api_keys_file, $%s): anyone who can reach "
            "it can use the API",
            cfg.http.host,
            cfg.auth.api_keys_env,
        )
    stop = threading.Event()

    def _on_signal(signum: int, _: Any) -> None:
        log.info("signal %d: shutting down", signum)
        stop.set()

    signal.signal(signal.SIGINT, _on_signal)
    signal.signal(signal.SIGTERM, _on_signal)
    t0 = time.time()
    start_ray(
        cfg,
        address=args.address,
        dashboard=not args.no_dashboard,
        metrics_port=args.metrics_port,
    )
    try:
        start_serve(cfg)
        try:
            app = build_app(cfg)
        except ValueError as e:  # a model or setting refused by name, before any replica
            print(f"tandem serve: cannot serve this model: {e}", file=sys.stderr)
            return 2
        serve.run(app, name="tandem", route_prefix="/", blocking=False)
        base = f"http://{cfg.http.host}:{cfg.http.port}"
        print(
            f"\ntandem is serving ({cfg.mode}, draft={cfg.draft.kind}) at {base} "
            f"after {time.time() - t0:.0f} s (metrics: http://127.0.0.1:{args.metrics_port}/metrics"
            f"{'' if args.no_dashboard else ', dashboard: http://127.0.0.1:8265'}). Try:\n",
            flush=True,
        )
        print(
            f"  curl {base}/v1/chat/completions -H 'Content-Type: application/json' -d "
            '\'{"model": "' + _model_name(cfg) + '", "messages": [{"role": "user", '
            '"content": "What is the capital of France?"}], "max_tokens": 64}\'\n',
            flush=True,
        )
        print("Ctrl-C stops it.", flush=True)
        while not stop.wait(0.5):
            pass
    finally:
        shutdown()
        print("tandem stopped.", flush=True)
    return 0


def _model_name(cfg: TandemConfig) -> str:
    from cluster.builder import resolve_models

    return resolve_models(cfg).name


def config_render_cmd(args: argparse.Namespace) -> int:
    """Print one app's Serve config, or rewrite (or --check) every rendered file under deploy/."""
    from pathlib import Path

    from cluster.render import serve_config_yaml
    from cluster.render_files import render_command

    if args.app:
        sys.stdout.write(serve_config_yaml(TandemConfig.from_yaml(args.app)))
        return 0
    return render_command(Path(args.deploy_dir), check=args.check, out=sys.stdout)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tandem", description=__doc__)
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("serve", help="start a local cluster and serve the OpenAI API")
    s.add_argument("--config", help="YAML config (see deploy/local.yaml); flags override it")
    s.add_argument("--model", help="model: 'embedded', an HF folder, a .gguf, or a cached HF id")
    s.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"], help=DTYPE_HELP)
    s.add_argument("--quantization", choices=["none", "int8", "fp8"], help=QUANTIZATION_HELP)
    s.add_argument("--tp", type=int, help="tensor-parallel size of every replica (both pools)")
    s.add_argument("--max-model-len", type=int, help="prompt plus output tokens per request")
    s.add_argument("--mode", choices=["disaggregated", "colocated"])
    s.add_argument("--draft", choices=["none", "ngram", "draft_model", "eagle"])
    s.add_argument(
        "--draft-source",
        help="the draft model's folder (draft_model) or the EAGLE head's ('embedded': the head "
        "shipped for the embedded model)",
    )
    s.add_argument("--host")
    s.add_argument("--port", type=int)
    s.add_argument("--address", help="join an existing Ray cluster instead of starting one")
    s.add_argument(
        "--set",
        action="append",
        type=_setting,
        metavar="KEY=VALUE",
        help="any config field by its dotted path, e.g. decode.num_blocks=4096 (repeatable; "
        "applied last)",
    )
    s.add_argument(
        "--metrics-port",
        type=int,
        default=8080,
        help="Prometheus metrics port of the local Ray (default 8080, as on clusters)",
    )
    s.add_argument(
        "--no-dashboard", action="store_true", help="start the local Ray without its dashboard"
    )
    s.set_defaults(fn=serve_cmd)
    c = sub.add_parser("config", help="app config tools").add_subparsers(dest="what", required=True)
    r = c.add_parser(
        "render",
        help="render Serve config files and KubeRay serveConfigV2 blocks from the app configs",
    )
    r.add_argument("app", nargs="?", help="print the Serve config of this app config only")
    r.add_argument("--deploy-dir", default="deploy", help="the deploy/ folder (default: ./deploy)")
    r.add_argument("--check", action="store_true", help="write nothing; exit 1 if out of date")
    r.set_defaults(fn=config_render_cmd)
    for command in entry_points(group=COMMANDS_GROUP):
        command.load()(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    args = build_parser().parse_args(argv)
    code: int = args.fn(args)
    return code


if __name__ == "__main__":
    sys.exit(main())
