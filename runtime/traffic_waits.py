"""A bucketed runner's kernel compiles and graph captures, and how many live traffic waited on:
those after ``serving`` (the start-up warm-up's are not counted)."""

from __future__ import annotations


class TrafficWaits:
    _serving_from: tuple[int, int] | None = None  # (compiles, captures) when serving began

    @property
    def compiles(self) -> int:
        """Attention kernels compiled so far (ragged steps' included)."""
        raise NotImplementedError

    @property
    def captures(self) -> int:
        """CUDA graphs captured so far."""
        raise NotImplementedError

    @property
    def is_serving(self) -> bool:
        return self._serving_from is not None

    def serving(self) -> None:
        """From here on steps are traffic's: their compiles and captures are counted."""
        self._serving_from = (self.compiles, self.captures)

    def during_traffic(self) -> tuple[int, int]:
        """(compiles, captures) since ``serving``: steps that waited on one."""
        compiles, captures = self._serving_from or (self.compiles, self.captures)
        return self.compiles - compiles, self.captures - captures
