"""The committed gRPC stubs are what ``make proto`` generates from ``cluster/proto/tandem.proto``
with the pinned grpcio-tools: a proto edited without regenerating fails here."""

from __future__ import annotations

from pathlib import Path

import pytest
from grpc_tools import protoc

ROOT = Path(__file__).resolve().parents[2]
PROTO = "cluster/proto/tandem.proto"
STUBS = ("tandem_pb2.py", "tandem_pb2.pyi", "tandem_pb2_grpc.py")


def test_committed_stubs_match_the_proto(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(ROOT)  # protoc names the file by its path from the include root
    outs = [f"--{kind}_out={tmp_path}" for kind in ("python", "grpc_python", "pyi")]
    assert protoc.main(["protoc", "-I.", *outs, PROTO]) == 0
    for name in STUBS:
        fresh = (tmp_path / "cluster" / "proto" / name).read_text()
        committed = (ROOT / "cluster" / "proto" / name).read_text()
        assert fresh == committed, f"cluster/proto/{name} is stale: run `make proto`"
