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
from models.request import FinishReason, Request

log = logging.getLogger(__name__)


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

    def _drain(self, block: bool) -> None:
        try:
            cmd = self._inbox.get(timeout=0.5) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            if isinstance(cmd, _Add):
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
        try:
            while not self._stop.is_set():
                self._drain(block=not self.engine.has_work)
                if not self.engine.has_work:
                    continue
                if self.engine.only_waiting_on_pulls:
                    time.sleep(0.0005)  # nothing to compute while reads land
                try:
                    outputs = self.engine.step()
                except Exception as e:  # a bug must not strand clients: fail what was running
                    log.exception("decode step failed")
                    outputs = self._fail_running(f"decode step failed: {e}")
                for out in outputs:
                    self.on_output(out)
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
            outs.append(StepOutput(rid, (), FinishReason.ERROR.value, SpecUsage(0, 0, 0, 0), error))
        return outs
