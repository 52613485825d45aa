"""Drives a ``DecodeEngine`` from its own thread, where it is built too: a second thread's OpenMP
team would oversubscribe the cores, and libgomp's idle workers then sleep between small ops."""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from decode.engine import DecodeEngine
from decode.outputs import SpecUsage, StepOutput
from kvtransfer.handoff import KVHandoff
from kvtransfer.tp_transport import RankTimeoutError
from models.request import FinishReason, Request

log = logging.getLogger(__name__)
IDLE_WAIT_S = 0.5


@dataclass(frozen=True)
class _Add:
    req: Request
    handoff: KVHandoff | None


@dataclass(frozen=True)
class _Abort:
    request_id: str


class EngineLoop:
    def __init__(
        self, build: Callable[[], DecodeEngine], on_output: Callable[[StepOutput], None]
    ) -> None:
        self._build = build
        self.on_output = on_output
        self._inbox: queue.SimpleQueue[_Add | _Abort | None] = queue.SimpleQueue()
        self._stop = threading.Event()
        self._built = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tandem-decode", daemon=True)
        self.error: BaseException | None = None
        self.wedged: str | None = None  # why the replica cannot serve (a TP rank went silent)
        # time.monotonic() of the last step, or of the last look at an engine with no work
        self.progress_at = time.monotonic()
        self._engine: DecodeEngine | None = None

    @property
    def engine(self) -> DecodeEngine:
        assert self._engine is not None, "the engine loop has not started"
        return self._engine

    def start(self) -> DecodeEngine:
        self._thread.start()
        self._built.wait()
        if self._engine is None:
            raise RuntimeError("the decode engine could not be built") from self.error
        return self._engine

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def submit(self, req: Request, handoff: KVHandoff | None) -> None:
        self._inbox.put(_Add(req, handoff))

    def abort(self, request_id: str) -> None:
        self._inbox.put(_Abort(request_id))

    def stop(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        self._inbox.put(None)
        self._thread.join(timeout_s)

    def stalled_s(self) -> float:
        """Seconds the engine has had work without finishing a step (0 while idle)."""
        if self._engine is None or not self._engine.has_work:
            return 0.0
        return time.monotonic() - self.progress_at

    def _drain(self, wait_s: float) -> None:
        try:
            cmd = self._inbox.get(timeout=wait_s) if wait_s > 0 else self._inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            if isinstance(cmd, _Add) and self.wedged is not None:
                # nothing new on a wedged replica: a silent rank's late reads may land in any
                # block it frees, until Serve replaces it
                self.on_output(
                    _failed(cmd.req.request_id, f"decode replica is wedged: {self.wedged}")
                )
            elif isinstance(cmd, _Add):
                self.engine.add(cmd.req, cmd.handoff)
            elif isinstance(cmd, _Abort):
                self.engine.abort(cmd.request_id)
            try:
                cmd = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _run(self) -> None:
        try:
            self._engine = self._build()
        except BaseException as e:
            self.error = e
            log.exception("building the decode engine failed")
            return
        finally:
            self._built.set()
        busy_since: float | None = None  # the last step's start, while the batch ran on
        try:
            while not self._stop.is_set():
                # nothing to compute: wait for a command, or for reads to land or blocks to free
                self._drain(self.engine.idle_wait_s if self.engine.has_work else IDLE_WAIT_S)
                if not self.engine.has_work:
                    self.progress_at = time.monotonic()
                    busy_since = None
                    continue
                started = time.perf_counter()
                if busy_since is not None:
                    self.engine.observe_cycle(started - busy_since)
                try:
                    outputs = self.engine.step()
                except RankTimeoutError as e:
                    self.wedged = str(e)
                    log.error("decode replica wedged: %s", e)
                    outputs = self._fail_running(f"decode step failed: {e}")
                except Exception as e:  # a bug must not strand clients: fail what was running
                    log.exception("decode step failed")
                    outputs = self._fail_running(f"decode step failed: {e}")
                self.progress_at = time.monotonic()
                for out in outputs:
                    self.on_output(out)
                # back to back only while a batch decodes (no wait for reads in between)
                busy_since = started if self.engine.running and self.engine.last_step_s else None
        except BaseException as e:  # pragma: no cover - surfaced through health checks
            self.error = e
            log.exception("decode loop died")
            raise

    def _fail_running(self, error: str) -> list[StepOutput]:
        outs = []
        e = self.engine
        held = [*e.running, *e.intake.pending, *(req.request_id for req, _, _ in e.waiting)]
        for rid in held:
            e.abort(rid)
            outs.append(_failed(rid, error))
        return outs


def _failed(request_id: str, error: str) -> StepOutput:
    return StepOutput(request_id, (), FinishReason.ERROR.value, SpecUsage(0, 0, 0, 0), error)
