"""Rotary position embedding scaling, read from an HF config's ``rope_scaling`` /
``rope_parameters``: the inverse frequencies, and the factor the cos/sin tables carry (YaRN's
attention factor)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

ROPE_TYPES = ("default", "linear", "llama3", "yarn")


@dataclass(frozen=True)
class RopeScaling:
    """``linear`` divides every frequency by ``factor``; ``llama3`` low ones only, blending
    between ``low_freq_factor`` and ``high_freq_factor``; ``yarn`` ramps from interpolated to
    extrapolated frequencies between the dimensions that turn ``beta_slow`` and ``beta_fast``
    times over the original context, and scales cos/sin by ``attention_factor``."""

    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True
    attention_factor: float = 1.0

    def inv_freq(self, head_dim: int, theta: float) -> torch.Tensor:
        base = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
        if self.rope_type == "linear":
            return base / self.factor
        if self.rope_type == "yarn":
            return self._yarn(head_dim, theta)
        if self.rope_type != "llama3":
            return base
        old = self.original_max_position_embeddings
        low_wavelen = old / self.low_freq_factor
        high_wavelen = old / self.high_freq_factor
        wavelen = 2 * math.pi / base
        scaled = torch.where(wavelen > low_wavelen, base / self.factor, base)
        smooth = (old / wavelen - self.low_freq_factor) / (
            self.high_freq_factor - self.low_freq_factor
        )
        blended = (1 - smooth) * scaled / self.factor + smooth * scaled
        between = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(between, blended, scaled)

    def _yarn(self, dim: int, theta: float) -> torch.Tensor:
        def correction_dim(rotations: float) -> float:
            old = self.original_max_position_embeddings
            return dim * math.log(old / (rotations * 2 * math.pi)) / (2 * math.log(theta))

        low, high = correction_dim(self.beta_fast), correction_dim(self.beta_slow)
        if self.truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, dim - 1)
        if low == high:
            high += 0.001  # no zero-width ramp
        ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
        pos = theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
        extrapolate = 1 - ramp  # per frequency: 1 keeps the original, 0 interpolates
        return (1.0 / (self.factor * pos)) * (1 - extrapolate) + (1.0 / pos) * extrapolate


def rope_params(cfg: dict[str, Any]) -> dict[str, Any]:
    """The full-attention layers' rope parameters (Gemma 3 nests them by layer type)."""
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    nested = rope.get("full_attention") if isinstance(rope, dict) else None
    return dict(nested) if isinstance(nested, dict) else dict(rope)


def _yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def rope_scaling(cfg: dict[str, Any]) -> RopeScaling:
    """Raises ValueError naming a rope field tandem does not implement."""
    rope = rope_params(cfg)
    kind = rope.get("rope_type", rope.get("type")) or "default"
    if kind not in ROPE_TYPES:
        raise ValueError(
            f"unsupported rope_scaling.rope_type {kind!r}: tandem implements {list(ROPE_TYPES)}"
        )
    if float(rope.get("partial_rotary_factor") or 1.0) != 1.0:
        raise ValueError(
            f"unsupported partial_rotary_factor {rope['partial_rotary_factor']!r}: only 1.0"
        )
    if kind != "yarn" and float(rope.get("attention_factor") or 1.0) != 1.0:
        raise ValueError(
            f"unsupported rope_scaling.attention_factor {rope['attention_factor']!r}: only 1.0"
        )
    if kind == "default":
        return RopeScaling()
    if "factor" not in rope:
        raise ValueError(f"rope_scaling.rope_type {kind!r} needs rope_scaling.factor")
    factor = float(rope["factor"])
    if kind == "linear":
        return RopeScaling("linear", factor)
    if kind == "yarn":
        old = int(rope.get("original_max_position_embeddings") or cfg["max_position_embeddings"])
        attention = rope.get("attention_factor")
        if attention is None:
            m, m_all = rope.get("mscale"), rope.get("mscale_all_dim")
            attention = (
                _yarn_mscale(factor, m) / _yarn_mscale(factor, m_all)
                if m and m_all
                else _yarn_mscale(factor)
            )
        return RopeScaling(
            "yarn",
            factor,
            original_max_position_embeddings=old,
            beta_fast=float(rope.get("beta_fast") or 32.0),
            beta_slow=float(rope.get("beta_slow") or 1.0),
            truncate=bool(rope.get("truncate", True)),
            attention_factor=float(attention),
        )
    return RopeScaling(
        "llama3",
        factor,
        float(rope.get("low_freq_factor", 1.0)),
        float(rope.get("high_freq_factor", 4.0)),
        int(rope.get("original_max_position_embeddings", 8192)),
    )
