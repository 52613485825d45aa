"""The cross-pool KV path check: once per ingress replica, a prefill replica serves a probe of a
handoff's size that a decode replica reads, as its pulls will; on a cluster the two sit on the
pools' own nodes, so this measures the fabric between them. ``/health`` shows the result."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

log = logging.getLogger(__name__)

CHECK_TIMEOUT_S = 600.0  # the pools may still be loading their models


class CrossPoolPathCheck:
    def __init__(self, prefill: Any, decode: Any) -> None:
        self.prefill = prefill
        self.decode = decode
        self.result: dict[str, Any] | None = None
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        """Starts the check on the running loop, once (later calls are no-ops)."""
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        try:
            call = self.prefill.check_kv_path.remote(self.decode)
            result: dict[str, Any] = await asyncio.wait_for(call, CHECK_TIMEOUT_S)
        except Exception as e:  # reported in /health; the pools serve regardless
            result = {"error": f"the cross-pool KV path check failed: {e!r}", "degraded": None}
        self.result = result
        why = result.get("degraded")
        where = "across nodes" if result.get("crosses_nodes") else "within one node"
        gbps = result.get("gbps")
        (log.warning if why or result.get("error") else log.info)(
            "KV path prefill -> decode %s: %s at %s%s",
            where,
            ", ".join(result.get("transports") or ()) or "transport unreported",
            f"{gbps:.2f} GB/s" if gbps is not None else "no bandwidth",
            f"; DEGRADED: {why}" if why else (f"; {result['error']}" if "error" in result else ""),
        )

    def snapshot(self) -> dict[str, Any]:
        return {"state": "measuring"} if self.result is None else dict(self.result)
