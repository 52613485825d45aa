"""An OpenAI-API conformance run nobody here wrote (``llm-comply``, PyPI) against ``make serve``'s
app: ``tandem serve --config deploy/local.yaml`` on a free port, then llm-comply's OpenAI Chat
and Open Responses suites, each check's outcome recorded with the documented refusal (if any)
that explains a failure.

    .venv/bin/python -m bench.compliance [--out bench/results/compliance.json]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import time
from importlib.metadata import version
from pathlib import Path
from typing import Any

import httpx

from runtime.ports import free_port

RESULTS = Path(__file__).parent / "results"
ROOT = Path(__file__).parents[1]
# checks that exercise what docs/api.md refuses by name, and where it says so
REFUSALS = {
    "chat-image-input": "image parts are refused (a text-only model): docs/api.md, Chat history",
    "image-input": "input_image parts are refused (a text-only model): docs/api.md, Responses",
    "chat-reasoning-summary": "reasoning_effort is refused: docs/api.md, Request fields",
    "reasoning-summary": "reasoning is refused: docs/api.md, Responses",
    "compact-response": "/v1/responses/compact is not served (404, which the check allows)",
}


def _serve(port: int) -> subprocess.Popen[bytes]:
    cmd = [
        str(ROOT / ".venv" / "bin" / "tandem"),
        "serve",
        "--config",
        "deploy/local.yaml",
        "--port",
        str(port),
        "--no-dashboard",
    ]
    return subprocess.Popen(cmd, cwd=ROOT, start_new_session=True)


def _wait(base: str, proc: subprocess.Popen[bytes], timeout_s: float = 600) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"tandem serve exited with {proc.returncode}")
        try:
            if httpx.get(f"{base}/health", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(2)
    raise TimeoutError("the app did not come up")


def _suite(base: str, fmt: str, model: str) -> dict[str, Any]:
    cmd = [str(ROOT / ".venv" / "bin" / "llm-comply"), "--format", fmt, "-u", f"{base}/v1"]
    cmd += ["-k", "none", "-m", model, "--json"]
    run = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=1800)
    out: dict[str, Any] = json.loads(run.stdout[run.stdout.index("{") :])
    for r in out["results"]:
        if r["status"] != "passed" and r["id"] in REFUSALS:
            r["documented_refusal"] = REFUSALS[r["id"]]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", type=Path, default=RESULTS / "compliance.json")
    args = ap.parse_args()
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    proc = _serve(port)
    try:
        _wait(base, proc)
        model = httpx.get(f"{base}/v1/models", timeout=30).json()["data"][0]["id"]
        suites = {fmt: _suite(base, fmt, model) for fmt in ("openai-chat", "open-responses")}
        report: dict[str, Any] = {
            "benchmark": "compliance",
            "tool": f"llm-comply {version('llm-comply')}",
            "app": "tandem serve --config deploy/local.yaml",
            "suites": suites,
        }
    finally:
        os.killpg(proc.pid, signal.SIGINT)
        proc.wait(timeout=120)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    for fmt, suite in suites.items():
        print(fmt, suite["summary"])
        for r in suite["results"]:
            if r["status"] != "passed":
                print("  ", r["id"], r["status"], r.get("documented_refusal") or r.get("errors"))


if __name__ == "__main__":
    main()
