"""The start-up check of the KV path a replica's pulls will take: another process reads a
realistic handoff from this one over NIXL, with the fabric's settings, and reports the bandwidth
and the transport UCX chose for its remote reads (``UCX_PROTO_INFO``). Unlike a loopback inside
one process, a forced or fallen-back TCP path shows (``software emulation`` over ``tcp``).

Runs beside the replica on a pool of its own (never the engine's agent), at low priority."""

from __future__ import annotations

import json
import os
import pickle
import re
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from kvtransfer.fabric import Fabric

CHECK_BYTES = 64 << 20  # a 1k-token prompt's KV of an 8B model is about 128 MiB
ROUNDS = 3
_READ_TABLE = re.compile(r"remote memory read by .*?\n((?:.*\|.*\n)+?).*\+-+\+\s*$", re.MULTILINE)
_ROW = re.compile(r"\|\s*[\d.]+(?:\.\.[\w.]+)?\s*\|\s*([^|]+?)\s*\|\s*([^|\s]+)\s*\|")


@dataclass(frozen=True)
class PathReport:
    fabric: str
    backend: str
    transports: tuple[str, ...]  # what UCX chose for remote reads, e.g. ("cma/memory",)
    emulated: bool  # a read in software (UCX over TCP) rather than one-sided
    gbps: float | None
    nbytes: int
    error: str | None = None

    def degraded(self, floor_gbps: float) -> str | None:
        """Why the path falls short of ``floor_gbps`` (None: it does not)."""
        if self.error is not None:
            return f"the KV path check failed: {self.error}"
        if self.gbps is not None and floor_gbps > 0 and self.gbps < floor_gbps:
            how = ", ".join(self.transports) or self.backend
            kind = " (emulated reads over TCP)" if self.emulated else ""
            return (
                f"KV pulls run at {self.gbps:.2f} GB/s over {how}{kind}, under "
                f"kv.min_path_gbps {floor_gbps:g} (fabric {self.fabric})"
            )
        return None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def read_transports(proto_info: str) -> tuple[tuple[str, ...], bool]:
    """The transports in UCX_PROTO_INFO's remote-read tables, and whether any is emulated."""
    found: list[str] = []
    emulated = False
    lines = proto_info.splitlines()
    for i, line in enumerate(lines):
        if "remote memory read" not in line:
            continue
        for row in lines[i + 1 : i + 12]:
            m = _ROW.search(row)
            if m is None:
                continue
            description, config = m.group(1), m.group(2)
            emulated |= "emulation" in description
            if config not in found:
                found.append(config)
    return tuple(found), emulated


class ProbeSource:
    """``nbytes`` of KV in a pool of its own, registered with NIXL and served (its agent driven
    from a thread: TCP reads need the target's progress) until ``close``."""

    def __init__(self, fabric: Fabric, device: str = "cpu", nbytes: int = CHECK_BYTES) -> None:
        from kvtransfer.nixl_transport import NixlTransport
        from kvtransfer.pool import KVGroupSpec, KVPool, KVPoolSpec

        blocks = 64
        heads = max(1, nbytes // (blocks * 16 * 2 * 128 * 4))
        self.spec = KVPoolSpec(blocks, 16, (KVGroupSpec("target", 1, heads, 128, "float32"),))
        self.fabric = fabric
        self._pool = KVPool(self.spec, device)
        self._src = NixlTransport(self._pool, f"pathcheck-{os.getpid()}", backend=fabric.backend)
        self._stop = threading.Event()
        self._driver = threading.Thread(target=self._drive, name="tandem-kv-path-source")
        self._driver.start()

    def _drive(self) -> None:
        while not self._stop.wait(0.0002):
            self._src.completed()

    def payload(self) -> bytes:
        """What a reader anywhere needs to pull the pool: the agent's metadata and layout."""
        return pickle.dumps((self._src.sources(), self.spec, self.fabric.backend))

    def close(self) -> None:
        self._stop.set()
        self._driver.join()
        self._src.close()


def read_from(
    payload: bytes, fabric: Fabric, device: str = "cpu", timeout_s: float = 120
) -> PathReport:
    """Pull a ``ProbeSource``'s pool into a process started here with the fabric's settings
    and ``UCX_PROTO_INFO`` on, timed, and report what UCX chose."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "sources.pkl"
        path.write_bytes(payload)
        env = dict(os.environ, UCX_PROTO_INFO="y")
        for key, value in fabric.env:
            env.setdefault(key, value)
        try:
            done = subprocess.run(
                [sys.executable, "-m", "kvtransfer.path_check", str(path), device],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                timeout=timeout_s,
                check=False,
                preexec_fn=lambda: os.nice(10),
            )
            out = done.stdout
        except subprocess.TimeoutExpired as e:
            out = (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
            out += f"\nthe reader ran past {timeout_s:g} s"
    transports, emulated = read_transports(out)
    result = _last_json(out)
    if result is None:
        tail = out.strip().splitlines()[-1:] or ["no output"]
        return PathReport(fabric.name, fabric.backend, transports, emulated, None, 0, tail[0])
    return PathReport(
        fabric.name,
        fabric.backend,
        transports,
        emulated,
        float(result["gbps"]),
        int(result["nbytes"]),
        result.get("error"),
    )


def measure(fabric: Fabric, device: str = "cpu", nbytes: int = CHECK_BYTES) -> PathReport:
    """Serve ``nbytes`` of KV from a pool here to a reader in another process."""
    source = ProbeSource(fabric, device, nbytes)
    try:
        return read_from(source.payload(), fabric, device)
    finally:
        source.close()


def _last_json(out: str) -> dict[str, Any] | None:
    for line in reversed(out.splitlines()):
        if line.startswith("{"):
            try:
                got: dict[str, Any] = json.loads(line)
                return got
            except ValueError:
                return None
    return None


def _read(path: str, device: str) -> dict[str, Any]:
    """The reader's side (another process): pull every block ROUNDS times, timed."""
    from kvtransfer.handoff import KVCompat, KVHandoff
    from kvtransfer.nixl_transport import NixlTransport
    from kvtransfer.pool import KVPool
    from kvtransfer.transport import PullState

    sources, spec, backend = pickle.loads(Path(path).read_bytes())
    pool = KVPool(spec, device)
    dst = NixlTransport(pool, "pathread", backend=backend)
    compat = KVCompat("check", "float32", spec.block_size, "check", 1, "none", "nixl")
    ids = tuple(range(spec.num_blocks))
    h = KVHandoff(
        "path-check", sources, ids, ("target",), len(ids) * spec.block_size, 0, compat, 60
    )
    seconds = 0.0
    for r in range(ROUNDS + 1):  # the first round connects and warms up: not timed
        t0 = time.perf_counter()
        pull = dst.start_pull(h, list(ids))
        while (state := dst.poll(pull)) is PullState.PENDING:
            pass
        dst.release(pull)
        if state is not PullState.DONE:
            return {"gbps": 0.0, "nbytes": 0, "error": f"a read ended {state.value}"}
        if r:
            seconds += time.perf_counter() - t0
    dst.close()
    return {"gbps": ROUNDS * pool.nbytes / seconds / 1e9, "nbytes": pool.nbytes}


if __name__ == "__main__":
    print(json.dumps(_read(sys.argv[1], sys.argv[2])), flush=True)


class PathProbe:
    """Runs ``measure`` once on a thread of its own; ``report`` is None until it ends."""

    def __init__(self, fabric: Fabric, device: str, floor_gbps: float, role: str) -> None:
        self.fabric = fabric
        self.floor_gbps = floor_gbps
        self.report: PathReport | None = None
        self._thread = threading.Thread(
            target=self._run, args=(device, role), name="tandem-kv-path-check", daemon=True
        )
        self._thread.start()

    def _run(self, device: str, role: str) -> None:
        import logging

        log = logging.getLogger(__name__)
        try:
            report = measure(self.fabric, device)
        except Exception as e:  # the check must never take the replica down
            report = PathReport(self.fabric.name, self.fabric.backend, (), False, None, 0, str(e))
        self.report = report
        why = report.degraded(self.floor_gbps)
        how = ", ".join(report.transports) or "transport unreported"
        speed = f"{report.gbps:.2f} GB/s" if report.gbps is not None else "no bandwidth"
        (log.warning if why else log.info)(
            "%s KV path (%s): remote reads by %s%s at %s over %d MiB between two processes%s",
            role,
            self.fabric.describe(),
            how,
            " (emulated over TCP)" if report.emulated else "",
            speed,
            report.nbytes >> 20,
            f"; DEGRADED: {why}" if why else "",
        )

    def snapshot(self) -> dict[str, Any]:
        if self.report is None:
            return {"state": "measuring", "fabric": self.fabric.name}
        return self.report.to_dict() | {"degraded": self.report.degraded(self.floor_gbps)}

    def wait(self, timeout_s: float) -> PathReport | None:
        self._thread.join(timeout_s)
        return self.report
