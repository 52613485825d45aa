"""Per-position draft stopping on the drafter's confidence, priced by the goodput model.

One more draft token for a request adds the chance that every token drafted so far and it are
accepted (about the product of the head's probabilities for them) and costs the step's marginal
seconds per scored token. A batch emitting ``g`` tokens/s gains from it while that chance exceeds
``g`` times the marginal cost: the cutoff on a draft's cumulative confidence. Light load makes
the marginal token nearly free (cutoff near 0: draft the whole plan); heavy load raises it.

The cutoff moves continuously with load, and is damped: an exponential average of the priced
value, adopted only when it leaves a band around the one in use. So a batch crossing any size
sees a gradual change, not the throughput cliff of per-batch draft-length schedules; exactness
is untouched (how far to draft depends only on the draft's own probabilities)."""

from __future__ import annotations


class DraftStop:
    def __init__(self, smoothing: float = 0.2, band: float = 0.25, floor: float = 0.01) -> None:
        self.smoothing = smoothing  # weight of the newest priced cutoff in the average
        self.band = band  # relative change of the average that moves the cutoff in use
        self.floor = floor  # changes below this absolute size are never a move
        self.cutoff = 0.0
        self._average = 0.0

    @staticmethod
    def priced(tokens_per_s: float, marginal_s_per_token: float) -> float:
        return min(max(tokens_per_s * marginal_s_per_token, 0.0), 1.0)

    def update(self, tokens_per_s: float, marginal_s_per_token: float) -> float:
        """The cutoff to use this step, given the planned batch's rate and marginal cost."""
        target = self.priced(tokens_per_s, marginal_s_per_token)
        self._average += self.smoothing * (target - self._average)
        if abs(self._average - self.cutoff) > max(self.band * self.cutoff, self.floor):
            self.cutoff = self._average
        return self.cutoff
