"""kv.fabric: what a node's devices say, the NIXL backend and environment each fabric takes, and
the start-up path check, which sees through a loopback: a forced TCP path is flagged."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from kvtransfer.fabric import apply, detect, resolve
from kvtransfer.path_check import measure, read_transports


def _device(root: Path, name: str, driver: str) -> None:
    dev = root / "sys" / "class" / "infiniband" / name / "device"
    dev.mkdir(parents=True)
    (root / "drivers" / driver).mkdir(parents=True, exist_ok=True)
    (dev / "driver").symlink_to(root / "drivers" / driver)


def test_detection_reads_the_nodes_devices(tmp_path: Path) -> None:
    assert detect(tmp_path)[0] == "tcp"
    efa = tmp_path / "aws"
    _device(efa, "rdmap16s27", "efa")
    assert detect(efa) == ("efa", "EFA devices rdmap16s27")
    ib = tmp_path / "ib"
    _device(ib, "mlx5_0", "mlx5_core")
    assert detect(ib)[0] == "ib"
    gcp = tmp_path / "gcp"
    (gcp / "dev" / "aperture_devices").mkdir(parents=True)
    assert detect(gcp)[0] == "tcpx"


def test_each_fabric_takes_its_backend_and_environment(tmp_path: Path) -> None:
    efa = resolve("efa", gpu=True)
    assert efa.backend == "LIBFABRIC" and ("FI_PROVIDER", "efa") in efa.env
    ib = dict(resolve("ib", gpu=True).env)
    assert "rc" in ib["UCX_TLS"] and "cuda_ipc" in ib["UCX_TLS"]
    assert ib["UCX_IB_GPU_DIRECT_RDMA"] == "yes"
    assert "cuda" not in dict(resolve("ib", gpu=False).env)["UCX_TLS"]
    tcpx = resolve("tcpx", gpu=True)
    assert tcpx.backend == "UCX" and "no GPUDirect-TCPX backend" in tcpx.why
    assert resolve("auto", gpu=False, root=tmp_path).name == "tcp"
    with pytest.raises(ValueError, match=r"kv\.fabric"):
        resolve("nvlink", gpu=True)


def test_the_operators_environment_wins(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("UCX_TLS", "rc_x,sm")
    monkeypatch.delenv("UCX_IB_GPU_DIRECT_RDMA", raising=False)
    set_now = apply(resolve("ib", gpu=True))
    assert os.environ["UCX_TLS"] == "rc_x,sm" and set_now == {"UCX_IB_GPU_DIRECT_RDMA": "yes"}


PROTO_INFO = """
[1] [vm:1 :0]   | tandem-dst0 intra-node cfg#1                                      |
[1] [vm:1 :0]   | remote memory read by ucp_get*(multi) into host memory from host |
[1] [vm:1 :0]   +--------+--------------------+------------------------------------+
[1] [vm:1 :0]   | Range  |    Description     |               Config               |
[1] [vm:1 :0]   +--------+--------------------+------------------------------------+
[1] [vm:1 :0]   | 0..inf | software emulation | tcp/lo                             |
[1] [vm:1 :0]   +--------+--------------------+------------------------------------+
[1] [vm:1 :0]   | active message by ucp_am_send*(egr) from host memory |
[1] [vm:1 :0]   |   1..16515 | zero-copy          | tcp/lo             |
"""


def test_ucx_proto_info_is_read() -> None:
    assert read_transports(PROTO_INFO) == (("tcp/lo",), True)


@pytest.mark.slow
def test_the_path_check_measures_another_process_and_flags_tcp(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Between two processes on this machine UCX reads over shared memory (CMA) in one-sided
    reads; with TCP forced (as on a node whose fabric was never set up), the check reports the
    reads emulated over TCP, and a floor above what TCP gives flags it."""
    monkeypatch.delenv("UCX_TLS", raising=False)  # an engine built earlier may have set it
    fabric = resolve("tcp", gpu=False)
    ok = measure(fabric, nbytes=16 << 20)
    assert ok.error is None and ok.gbps is not None and ok.gbps > 0, ok
    assert ok.transports and not ok.emulated and not any("tcp" in t for t in ok.transports)
    monkeypatch.setenv("UCX_TLS", "tcp")  # the operator's setting wins over the fabric's
    slow = measure(fabric, nbytes=16 << 20)
    assert slow.error is None and slow.emulated and any("tcp" in t for t in slow.transports)
    assert ok.degraded(0.0) is None and slow.degraded(0.0) is None  # no floor: reported only
    why = slow.degraded(1000.0)
    assert why is not None and "tcp" in why and "emulated" in why
