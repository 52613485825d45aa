"""The user-facing configuration: one pydantic model, loadable from YAML.

Every field is described; cross-field rules are checked with messages a user can act on.
``deploy/local.yaml`` is an example; ``tandem serve --config FILE`` loads it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import yaml
from pydantic import Field, model_validator

from cluster.api_config import AuthConfig, HTTPConfig, LimitsConfig
from cluster.api_config import Frozen as _Frozen
from cluster.model_config import DraftConfig, ModelConfig
from cluster.pool_config import DecodeConfig, PrefillConfig


class KVConfig(_Frozen):
    block_size: int = Field(16, ge=1, le=1024, description="Tokens per KV block.")
    transport: Literal["auto", "nixl", "object_store"] = Field(
        "auto",
        description="How KV moves from prefill to decode: NIXL one-sided reads; the Ray object "
        "store (a slower fallback); or auto: NIXL when its start-up self-check passes, else the "
        "fallback (logged, and shown in /health).",
    )
    failure_policy: Literal["recompute", "fail"] = Field(
        "recompute",
        description="When a KV pull fails (prefill replica gone, lease expired, timeout): "
        "compute the prompt on decode instead, or end the request with a 503 error.",
    )
    pull_timeout_s: float = Field(10.0, gt=0, description="A KV pull running longer has failed.")


class TandemConfig(_Frozen):
    mode: Literal["disaggregated", "colocated"] = Field(
        "disaggregated",
        description="disaggregated: prefill and decode deployments on separate pools with KV "
        "shipped between them; colocated: one decode deployment computes prompts itself.",
    )
    model: ModelConfig = Field(default_factory=ModelConfig, description="The target model.")
    draft: DraftConfig = Field(default_factory=DraftConfig, description="Speculative drafting.")
    kv: KVConfig = Field(default_factory=KVConfig, description="KV cache layout.")
    prefill: PrefillConfig = Field(default_factory=PrefillConfig, description="Prefill pool.")
    decode: DecodeConfig = Field(default_factory=DecodeConfig, description="Decode pool.")
    http: HTTPConfig = Field(default_factory=HTTPConfig, description="HTTP endpoint.")
    limits: LimitsConfig = Field(default_factory=LimitsConfig, description="Request limits.")
    auth: AuthConfig = Field(default_factory=AuthConfig, description="API keys.")

    @model_validator(mode="after")
    def _slo_speculation_is_adaptive(self) -> TandemConfig:
        if self.decode.speculation_tpot_slo_s is not None and not (
            self.draft.adaptive and self.draft.kind != "none"
        ):
            raise ValueError(
                "decode.speculation_tpot_slo_s is set but speculation is not adaptive "
                f"(draft.kind={self.draft.kind}, draft.adaptive={self.draft.adaptive}): only "
                "adaptive speculation chooses its drafts per step; set draft.adaptive: true with "
                "a drafter, or unset decode.speculation_tpot_slo_s"
            )
        return self

    @model_validator(mode="after")
    def _decode_always_up(self) -> TandemConfig:
        a = self.decode.autoscaling
        if self.mode == "disaggregated" and a is not None and a.min_replicas == 0:
            raise ValueError(
                "decode.autoscaling.min_replicas must be at least 1 in disaggregated mode: "
                "prefill leases shipped KV for only prefill.lease_seconds, less than a decode "
                "replica takes to start from zero"
            )
        return self

    @classmethod
    def from_yaml(cls, path: str | Path) -> TandemConfig:
        data = yaml.safe_load(Path(path).read_text()) or {}
        return cls.model_validate(data)

    def with_overrides(self, **dotted: object) -> TandemConfig:
        """A copy with fields replaced by dotted path, e.g. ``model.source='/m'``."""
        data = self.model_dump(exclude_unset=True)  # fields left unset stay unset
        for key, value in dotted.items():
            node = data
            *parents, leaf = key.split(".")
            for p in parents:
                node = node.setdefault(p, {})
            node[leaf] = value
        return TandemConfig.model_validate(data)

    def local_resources(self) -> dict[str, float]:
        """Custom resources a one-machine Ray cluster needs to simulate both pools."""
        res = {self.decode.resource: float(self.decode.most_replicas() * self.decode.tp)}
        if self.mode == "disaggregated":
            res[self.prefill.resource] = float(self.prefill.most_replicas() * self.prefill.tp)
        return res
