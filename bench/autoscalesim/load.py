"""The day the autoscaling simulator runs: arrival rate and request mix per control interval.

- **rate**, as a fraction of the peak: a diurnal cosine from ``trough`` at ``trough_at`` of the
  day to 1 half a day later, times a slow random factor (log-normal with standard deviation
  ``noise``, AR(1) with correlation time ``noise_tau_s``): the bursts a scaler has to absorb
  through its delays and the replicas' start-up;
- **mix**: the DEFAULT_MIX classes' arrival shares go from copy-heavy (``COPY_HEAVY``) at the
  start of the day to creative (``CREATIVE``) at its middle and back,
  ``x = (1 - cos(2 pi t / T)) / 2`` of the way, quantised to ``mix_levels`` levels so each
  level's replica curve (``replica.py``) is computed once.

With the defaults the rate at 10:00 equals the rate at 22:00 (both six hours from the 16:00
peak) while the mix is nearly all the way creative at the first and copy-heavy at the second:
the same arrivals needing different capacity.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]

# arrival shares of DEFAULT_MIX's classes: code_copy, chat, creative
COPY_HEAVY = (0.7, 0.2, 0.1)
CREATIVE = (0.1, 0.2, 0.7)


@dataclass(frozen=True)
class DayConfig:
    """The simulated day and its control interval."""

    minutes: float = 24 * 60
    step_s: float = 10.0  # control interval: metrics, decisions and the fluid state per step
    trough: float = 0.2  # the lowest arrival rate, as a fraction of the peak
    trough_at: float = 4 / 24  # where in the day the rate is lowest (the peak half a day on)
    noise: float = 0.05  # std. dev. of the log of the rate's random factor
    noise_tau_s: float = 300.0  # its correlation time
    mix_levels: int = 11  # mixes between COPY_HEAVY and CREATIVE (both included)
    seed: int = 0

    @property
    def steps(self) -> int:
        return round(self.minutes * 60 / self.step_s)

    @property
    def peak_at(self) -> float:
        """Where in the day the rate peaks (before noise), as a fraction of it."""
        return (self.trough_at + 0.5) % 1.0


@dataclass(frozen=True)
class DayLoad:
    """Arrivals per control interval."""

    rate: FloatArray  # [steps] arrival rate over the peak's (noise included)
    creative: FloatArray  # [steps] x: how far the mix is from COPY_HEAVY to CREATIVE
    level: IntArray  # [steps] the mix level (index into ``levels``) x is quantised to
    levels: tuple[tuple[float, ...], ...]  # [mix_levels] class shares of each level


def mix_levels(n: int) -> tuple[tuple[float, ...], ...]:
    """``n`` class-share tuples evenly between COPY_HEAVY and CREATIVE."""
    return tuple(
        tuple((1 - x) * a + x * b for a, b in zip(COPY_HEAVY, CREATIVE, strict=True))
        for x in np.linspace(0.0, 1.0, n)
    )


def mix_level(cfg: DayConfig, day_fraction: float) -> int:
    """The mix level at ``day_fraction`` of the day."""
    x = (1 - math.cos(2 * math.pi * day_fraction)) / 2
    return round(x * (cfg.mix_levels - 1))


def day_load(cfg: DayConfig) -> DayLoad:
    t = (np.arange(cfg.steps) + 0.5) * cfg.step_s / (cfg.minutes * 60)  # [steps] day fraction
    diurnal = cfg.trough + (1 - cfg.trough) * (1 - np.cos(2 * np.pi * (t - cfg.trough_at))) / 2
    x = (1 - np.cos(2 * np.pi * t)) / 2  # [steps]
    level = np.rint(x * (cfg.mix_levels - 1)).astype(np.int64)
    return DayLoad(diurnal * _noise(cfg), x, level, mix_levels(cfg.mix_levels))


def _noise(cfg: DayConfig) -> FloatArray:
    """[steps] a log-normal AR(1) factor of mean 1."""
    rng = np.random.default_rng(cfg.seed)
    rho = math.exp(-cfg.step_s / cfg.noise_tau_s)
    shocks = rng.standard_normal(cfg.steps) * math.sqrt(1 - rho * rho)  # [steps]
    z = np.empty(cfg.steps)  # [steps] unit-variance AR(1)
    z[0] = rng.standard_normal()
    for i in range(1, cfg.steps):
        z[i] = rho * z[i - 1] + shocks[i]
    out: FloatArray = np.exp(cfg.noise * z - cfg.noise**2 / 2)
    return out
