"""Which Serve replica and Ray node this process is (empty outside them: tests, benchmarks)."""

from __future__ import annotations


def replica_id() -> str:
    from ray import serve
    from ray.serve.exceptions import RayServeException

    try:
        return str(serve.get_replica_context().replica_id.unique_id)
    except RayServeException:
        return ""


def node_id() -> str:
    import ray

    return ray.get_runtime_context().get_node_id() if ray.is_initialized() else ""
