"""Which network fabric KV crosses between nodes, and how NIXL is set up for it (``kv.fabric``).

``auto`` looks at the node: EFA devices (AWS p4d/p5) take NIXL's LIBFABRIC backend with the EFA
provider; InfiniBand or RoCE devices take UCX with its verbs transports (and GPU memory
registration for VRAM pools); GCP's GPUDirect-TCPX has no NIXL backend, so it runs UCX over TCP and
says so; anything else is TCP. The environment is set only where the operator has not set it."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)
FABRICS = ("auto", "efa", "ib", "tcpx", "tcp")


@dataclass(frozen=True)
class Fabric:
    name: str  # efa | ib | tcpx | tcp
    backend: str  # NIXL's backend plugin: LIBFABRIC | UCX
    env: tuple[tuple[str, str], ...]  # set before the agent starts, unless already set
    why: str  # how it was chosen (logged once, shown in /health)

    def describe(self) -> str:
        return f"{self.name} over NIXL {self.backend} ({self.why})"


def _driver(dev: Path) -> str:
    try:
        return (dev / "device" / "driver").resolve().name
    except OSError:
        return ""


def detect(root: Path = Path("/")) -> tuple[str, str]:
    """(fabric, the evidence) for the node whose filesystem is at ``root``."""
    ib = root / "sys" / "class" / "infiniband"
    devices = sorted(ib.iterdir()) if ib.is_dir() else []
    efa = [d.name for d in devices if _driver(d) == "efa" or d.name.startswith("efa")]
    if efa:
        return "efa", f"EFA devices {', '.join(efa)}"
    if devices:
        return "ib", f"RDMA devices {', '.join(d.name for d in devices)}"
    if (root / "dev" / "aperture_devices").exists() or (root / "run" / "tcpx").exists():
        return "tcpx", "GPUDirect-TCPX(O) devices"
    return "tcp", "no RDMA device under /sys/class/infiniband"


def resolve(choice: str, gpu: bool, root: Path = Path("/")) -> Fabric:
    if choice not in FABRICS:
        raise ValueError(f"kv.fabric must be one of {', '.join(FABRICS)}, not {choice!r}")
    name, why = detect(root) if choice == "auto" else (choice, f"configured: kv.fabric={choice}")
    cuda = ",cuda_copy,cuda_ipc" if gpu else ""
    if name == "efa":
        env = [("FI_PROVIDER", "efa")] + ([("FI_EFA_USE_DEVICE_RDMA", "1")] if gpu else [])
        return Fabric(name, "LIBFABRIC", tuple(env), why)
    if name == "ib":
        # tcp last: a peer on no RDMA network with this node (GCP's A3 High beside A3 Ultra)
        # still connects, and the cross-pool path check names the TCP it took
        env = [("UCX_TLS", "rc,ud,sm,self" + (cuda + ",gdr_copy" if gpu else "") + ",tcp")]
        if gpu:
            env.append(("UCX_IB_GPU_DIRECT_RDMA", "yes"))
        return Fabric(name, "UCX", tuple(env), why)
    if name == "tcpx":
        why += "; NIXL has no GPUDirect-TCPX backend: KV crosses nodes over UCX's TCP"
    return Fabric(name, "UCX", (("UCX_TLS", "tcp,sm,self" + cuda),), why)


def apply(fabric: Fabric) -> dict[str, str]:
    """Set the fabric's environment where unset; returns what was set (the rest was the
    operator's)."""
    set_now = {}
    for key, value in fabric.env:
        if key not in os.environ:
            os.environ[key] = value
            set_now[key] = value
    return set_now
