"""The committed gRPC stubs are what ``make proto`` generates from ``cluster/proto/tandem.proto``
with the pinned grpcio-tools: a proto edited without regenerating fails here."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PROTO = "cluster/proto/tandem.proto"
STUBS = ("tandem_pb2.py", "tandem_pb2.pyi", "tandem_pb2_grpc.py")


def test_committed_stubs_match_the_proto(tmp_path: Path) -> None:
    # In a subprocess: grpc_tools' compiler brings its own libprotobuf, and loading it into
    # this process makes a later NIXL import abort (duplicate native symbols). The cwd matters:
    # protoc names the file by its path from the include root.
    outs = [f"--{kind}_out={tmp_path}" for kind in ("python", "grpc_python", "pyi")]
    cmd = [sys.executable, "-m", "grpc_tools.protoc", "-I.", *outs, PROTO]
    subprocess.run(cmd, cwd=ROOT, check=True, timeout=120)
    for name in STUBS:
        fresh = (tmp_path / "cluster" / "proto" / name).read_text()
        committed = (ROOT / "cluster" / "proto" / name).read_text()
        assert fresh == committed, f"cluster/proto/{name} is stale: run `make proto`"
