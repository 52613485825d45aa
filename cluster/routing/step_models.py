"""The step-time models a router scores replicas with: one per distinct model, shared by every
replica that publishes it, each tabulated once for scoring all rows at a time (``StepTable``).
Replicas refine their models while serving, so a model no replica uses any more is dropped."""

from __future__ import annotations

from cluster.routing.score import StepTable
from decode.goodput import StepTimeModel


class StepModels:
    def __init__(self) -> None:
        self.models: dict[int, StepTimeModel] = {}
        self.steps: dict[int, StepTable] = {}
        self._ids: dict[tuple[tuple[int, float], ...], int] = {}
        self._refs: dict[int, int] = {}  # rows using each model
        self._next = 0

    def index(self, model: StepTimeModel | None) -> int:
        """The id of ``model`` (-1 for none); equal models share one."""
        if model is None:
            return -1
        i = self._ids.get(model.points)
        if i is None:
            i = self._ids[model.points] = self._next
            self._next += 1
            self.models[i], self.steps[i] = model, StepTable.of(model)
            self._refs[i] = 0
        return i

    def acquire(self, mid: int, rows: int) -> None:
        """``rows`` more rows use model ``mid``."""
        if mid >= 0:
            self._refs[mid] += rows

    def release(self, mid: int, rows: int) -> None:
        """``rows`` rows stopped using model ``mid``; at none it is dropped."""
        if mid < 0:
            return
        self._refs[mid] -= rows
        if self._refs[mid] == 0:
            del self._ids[self.models.pop(mid).points]
            del self.steps[mid], self._refs[mid]
