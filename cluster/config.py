"""The user-facing configuration: ``TandemConfig``, one pydantic model loadable from YAML (the
serving topology, with ``cluster.model_config`` and ``cluster.api_config``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import Field, field_validator, model_validator

from cluster.api_config import (
    GRPC_SERVICER_FUNCTIONS,
    AuthConfig,
    GrpcConfig,
    HTTPConfig,
    IngressConfig,
    LimitsConfig,
    LogConfig,
)
from cluster.api_config import Frozen as _Frozen
from cluster.autoscaling import (
    AutoscalingConfig,
    DecodeAutoscalingConfig,
    PrefillAutoscalingConfig,
    serve_scaling,
)
from cluster.model_config import DraftConfig, ModelConfig
from speculation.goodput import GUARD_MAX_LOSS


class PoolConfig(_Frozen):
    replicas: int = Field(
        1, ge=1, description="Serve replicas of this pool's deployment (a fixed count)."
    )
    autoscaling: AutoscalingConfig | None = Field(
        None,
        description="Let Ray Serve scale this pool's replicas between bounds instead of a fixed "
        "`replicas` count.",
    )
    tp: int = Field(1, ge=1, description="Tensor-parallel size of each replica.")
    num_blocks: int = Field(
        512, ge=1, description="KV blocks per replica (with gpu_memory_utilization: the least)."
    )
    device: Literal["auto", "cpu", "cuda"] = Field(
        "auto", description="Where the models run; 'auto' picks CUDA when a GPU is visible."
    )
    num_threads: int = Field(0, ge=0, description="torch CPU threads per replica (0: default).")
    switch_interval_s: float | None = Field(
        0.0002,
        gt=0,
        le=0.1,
        description="Python's thread switch interval in each replica's process "
        "(sys.setswitchinterval). The engine's thread releases the GIL in every torch op and "
        "takes it back after; whenever the replica's other threads (Serve's event loop "
        "streaming tokens, Ray's) are running Python, it waits up to this long for it, "
        "thousands of times a step. null keeps the interpreter's 0.005 s.",
    )
    gpu_fraction: float = Field(
        1.0,
        gt=0,
        le=1,
        description="Share of one GPU each replica reserves (device cuda, tp 1). Below 1, Ray "
        "places several replicas on one GPU (a one-GPU machine can run prefill and two decode "
        "replicas); they share its memory, so the model, draft and num_blocks of each must fit "
        "their share, which is not checked.",
    )
    gpu_memory_utilization: float | None = Field(
        None,
        gt=0,
        le=1,
        description="Size each replica's KV pool from GPU memory: this share of the device, "
        "less the loaded models and the largest step's activations (profiled at start-up), "
        "goes to the pool, in whole blocks. num_blocks is then the least the pool may hold: a "
        "replica with less memory refuses to start, naming the numbers. CUDA only; with tp > 1 "
        "every rank profiles its shard and the pools take the fewest blocks any rank holds.",
    )
    resource: str = Field(..., description="Ray custom resource that marks this pool's nodes.")
    onednn_cache_capacity: int | None = Field(
        None,
        ge=1,
        description="Matmul shapes each replica's process keeps compiled, in oneDNN's primitive "
        "cache and PyTorch's cache of oneDNN operations (ONEDNN_PRIMITIVE_CACHE_CAPACITY, "
        "LRU_CACHE_CAPACITY; CPU). Each entry holds memory; null keeps the libraries' 1024, "
        "right for decode, whose steps reuse a few shapes.",
    )
    max_ongoing_requests: int = Field(
        256, ge=1, description="Requests one replica accepts at once (Ray Serve)."
    )
    max_queued_requests: int = Field(
        256,
        description="Requests waiting for this pool beyond its replicas' max_ongoing_requests, "
        "per caller; more are answered 429 at once (Ray Serve backpressure). -1: unbounded.",
    )
    drain_timeout_s: float = Field(
        60.0,
        gt=0,
        description="When a replica is stopped (scale-down, redeploy), how long its in-flight "
        "requests may run on before it is killed. The HTTP ingress, which every client stream "
        "passes through, drains for the longest of the pools' timeouts.",
    )

    @model_validator(mode="after")
    def _memory_sizing(self) -> PoolConfig:
        u = self.gpu_memory_utilization
        if u is not None and self.device == "cpu":
            raise ValueError(
                f"gpu_memory_utilization={u:g} sizes the KV pool from GPU memory; on device "
                "cpu set num_blocks"
            )
        if u is not None and self.gpu_fraction < 1:
            raise ValueError(
                f"gpu_memory_utilization={u:g} with gpu_fraction={self.gpu_fraction:g}: replicas "
                "sharing a GPU would each size their pool from the whole device; set num_blocks"
            )
        return self

    @model_validator(mode="after")
    def _gpu_share(self) -> PoolConfig:
        if self.gpu_fraction < 1 and self.device != "cuda":
            raise ValueError(
                f"gpu_fraction={self.gpu_fraction:g} needs device: cuda (cpu and auto reserve "
                "no GPU)"
            )
        if self.gpu_fraction < 1 and self.tp > 1:
            raise ValueError(
                f"gpu_fraction={self.gpu_fraction:g} needs tp 1: each tensor-parallel rank "
                f"takes a GPU of its own (tp={self.tp})"
            )
        return self

    @model_validator(mode="after")
    def _scaling(self) -> PoolConfig:
        a = self.autoscaling
        if a is None:
            return self
        if "replicas" in self.model_fields_set:
            raise ValueError(
                "set either replicas (a fixed count) or autoscaling (bounds), not both"
            )
        if a.target_ongoing_requests > self.max_ongoing_requests:
            raise ValueError(
                f"autoscaling.target_ongoing_requests ({a.target_ongoing_requests:g}) exceeds "
                f"max_ongoing_requests ({self.max_ongoing_requests}): a replica could never "
                "reach its target; lower the target or raise max_ongoing_requests"
            )
        return self

    @field_validator("max_queued_requests")
    @classmethod
    def _queue_bound(cls, v: int) -> int:
        if v < 1 and v != -1:
            raise ValueError("max_queued_requests must be -1 (unbounded) or at least 1")
        return v

    def most_replicas(self) -> int:
        """The most replicas this pool runs: the fixed count, or autoscaling.max_replicas."""
        return self.autoscaling.max_replicas if self.autoscaling else self.replicas

    def scaling_options(self) -> dict[str, Any]:
        """``serve.deployment`` options that size this pool (fixed count or autoscaling)."""
        return serve_scaling(self.replicas, self.autoscaling)


class PrefillConfig(PoolConfig):
    resource: str = Field("prefill_pool", description="Ray custom resource of prefill nodes.")
    onednn_cache_capacity: int | None = Field(
        64,
        ge=1,
        description="As for any pool; 64 here: a prefill forward's token count is new nearly "
        "every time, so a cache of 1024 shapes mostly grows and "
        "rarely hits, while 64 holds every shape of the forwards in flight.",
    )
    autoscaling: PrefillAutoscalingConfig | None = Field(
        None,
        description="Scale prefill replicas on queued prompts (see cluster/autoscaling.py) "
        "instead of a fixed `replicas` count.",
    )
    probe_window: int = Field(
        16, ge=1, description="Prompt positions the acceptance probe averages over."
    )
    lease_seconds: float = Field(
        30.0, gt=0, description="How long prefill keeps shipped KV blocks for decode to pull."
    )
    max_num_batched_tokens: int = Field(
        2048,
        ge=1,
        description="Prompt tokens per prefill forward: longer prompts are chunked, shorter ones "
        "share a forward.",
    )
    enable_prefix_caching: bool = Field(
        True, description="Reuse the KV of full blocks a previous prompt already computed."
    )
    routing: Literal["power_of_two", "prefix_affinity"] = Field(
        "prefix_affinity",
        description="How the ingress picks a prefill replica: Ray Serve's power of two choices, "
        "or power of two with affinity to the replica that last prefilled the prompt's leading "
        "KV blocks (cluster/routing/prefix.py).",
    )
    routing_imbalance: float = Field(
        4.0,
        ge=0,
        description="prefix_affinity: requests in flight the affine replica may have beyond the "
        "lighter of two random ones before the prompt goes to that one instead.",
    )


DecodeRouting = Literal["round_robin", "power_of_two", "least_kv", "acceptance_aware", "slo_aware"]


class DecodeConfig(PoolConfig):
    resource: str = Field("decode_pool", description="Ray custom resource of decode nodes.")
    num_blocks: int = Field(
        1024, ge=1, description="KV blocks per replica (with gpu_memory_utilization: the least)."
    )
    max_batch_size: int = Field(64, ge=1, description="Sequences per decode step.")
    max_num_batched_tokens: int = Field(
        2048,
        ge=1,
        description="Tokens per decode step: one per running sequence plus its drafts, plus "
        "chunks of prompts computed on decode (colocated mode, recomputation).",
    )
    autoscaling: DecodeAutoscalingConfig | None = Field(
        None,
        description="Scale decode replicas on ongoing streams (see cluster/autoscaling.py) "
        "instead of a fixed `replicas` count.",
    )
    routing: DecodeRouting = Field(
        "acceptance_aware",
        description="How the ingress picks a decode replica: in turn; Ray Serve's power of two "
        "choices; most free KV blocks; where the request's expected acceptance adds least to "
        "the replicas' time per output token (cluster/routing/score.py); or slo_aware: the "
        "same, after keeping the request and the ones running beside it within "
        "routing_tpot_slo_s. All but round_robin and power_of_two use the replicas' routing "
        "stats and fall back to power of two choices while those are missing or stale; "
        "acceptance_aware and slo_aware also need adaptive speculation's measured step time "
        "(draft.adaptive).",
    )
    routing_tpot_slo_s: float | None = Field(
        None,
        gt=0,
        le=10,
        description="slo_aware routing: the time per output token (seconds) each request should "
        "stay within; the router places a request where its predicted TPOT and that of the "
        "slowest request already there stay below it, where it can.",
    )
    speculation_tpot_slo_s: float | None = Field(
        None,
        gt=0,
        le=10,
        description="Adaptive speculation (draft.adaptive) keeps drafts from pushing any "
        "running request's time per output token (seconds) past this: a step drafts only where "
        "every request in it stays within the SLO, or within the step without drafts where "
        "that is longer already. Drafts that would raise the batch's throughput by making "
        "low-acceptance requests beside them miss it are not taken, unless that costs more "
        "than speculation_tpot_slo_max_loss of the step's goodput. Usually the same value as "
        "routing_tpot_slo_s; unset, speculation maximises throughput alone.",
    )
    acceptance_alarm_ratio: float = Field(
        0.5,
        gt=0,
        lt=1,
        description="A replica reports a calibration cell (temperature x probe bin) as "
        "collapsed when its drafts' realised acceptance falls below this share of what their "
        "starting estimates predicted (speculation/acceptance_alarm.py): /health and the "
        "tandem_acceptance_collapsed_cells gauge say so, and adaptive speculation starts that "
        "cell's requests from the realised rate until predictions and outcomes agree again.",
    )
    acceptance_alarm_window_tokens: int = Field(
        1024,
        ge=16,
        description="Draft tokens per cell the acceptance alarm compares over (older ones fade); "
        "a cell needs half of it before it can be reported.",
    )
    max_queue_wait_s: float = Field(
        60.0,
        gt=0,
        description="Most seconds a request waits on a replica for KV blocks (the pool full of "
        "running requests, or blocks held by unfinished reads); then it ends with a 503 naming "
        "this setting.",
    )
    watchdog_s: float = Field(
        120.0,
        gt=0,
        description="A replica whose engine has had work but finished no step for this long "
        "fails its health check, and Ray Serve replaces it (a hung collective, a wedged "
        "device).",
    )
    max_stalled_preemptions: int = Field(
        4,
        ge=1,
        le=1000,
        description="A request preempted this many times in a row without producing a token "
        "(it cannot fit beside the others and would be recomputed and preempted forever) ends "
        "with an error naming the pool; below that it waits at the head of the queue for room "
        "to finish.",
    )
    stream_interval_s: float = Field(
        0.0,
        ge=0,
        le=1.0,
        description="Least time between a stream's messages from decode to the ingress: tokens "
        "of steps in between travel together (the first and last token are never held). 0: a "
        "message per step, steps that queued while one was in flight coalesced.",
    )
    step_shapes: Literal["auto", "bucketed", "ragged"] = Field(
        "auto",
        description="bucketed: decode and verification steps at fixed shapes through "
        "persistent input buffers, each shape captured once as a CUDA graph on a GPU; ragged: "
        "every step laid out as it comes (prompt chunks and draft trees always are); auto: "
        "bucketed on a GPU, ragged on a CPU.",
    )
    warm_up: Literal["auto", "on", "off"] = Field(
        "auto",
        description="Step every bucket once at start-up, before serving, so each CUDA graph is "
        "captured and each attention kernel compiled then, never under traffic (what traffic "
        "still compiles or captures is counted in /health and metrics); auto: on a GPU with "
        "bucketed steps.",
    )
    overlap: Literal["auto", "on", "off"] = Field(
        "auto",
        description="Plan and launch decode step n + 1 while the device runs step n, feeding "
        "its plain decodes the tokens step n sampled straight from the device, then read step "
        "n (what step n ends is dropped from n + 1); a TP group's other ranks get those tokens "
        "over its collectives. Steps with drafts or logit processors are read before the next "
        "is planned; auto: on a GPU.",
    )
    speculation_tpot_slo_max_loss: float = Field(
        GUARD_MAX_LOSS,
        ge=0,
        le=1,
        description="The most of a step's goodput (a fraction) speculation_tpot_slo_s may give "
        "up; where keeping to the SLO would cost more, the step drafts for throughput. Under "
        "open-loop load lost throughput lengthens every step (requests that do not draft stay "
        "longer and the batch grows): where drafts cost little beside the step (prompt lookup "
        "on a CPU) an unbounded guard takes every request past the SLO. 1 always keeps to the "
        "SLO; 0 keeps to it only where that costs nothing.",
    )
    routing_stats_period_s: float = Field(
        1.0,
        gt=0,
        description="How often each decode replica publishes its routing stats (load, "
        "acceptance estimates, speculation lengths, step-time model) to the routers.",
    )
    routing_max_staleness_s: float = Field(
        5.0,
        gt=0,
        description="Routing stats older than this are not used: the router treats the replica "
        "as unknown (power of two choices).",
    )

    @model_validator(mode="after")
    def _slo_routing_has_an_slo(self) -> DecodeConfig:
        if self.routing == "slo_aware" and self.routing_tpot_slo_s is None:
            raise ValueError(
                "decode.routing is slo_aware but decode.routing_tpot_slo_s is not set: give the "
                "TPOT SLO in seconds (e.g. 0.05), or choose routing: acceptance_aware"
            )
        return self

    @model_validator(mode="after")
    def _staleness_covers_period(self) -> DecodeConfig:
        if self.routing_max_staleness_s < self.routing_stats_period_s:
            raise ValueError(
                f"decode.routing_max_staleness_s ({self.routing_max_staleness_s:g}) is shorter "
                f"than decode.routing_stats_period_s ({self.routing_stats_period_s:g}): every "
                "replica's stats would go stale between refreshes; make the bound at least the "
                "period (two to five periods is typical)"
            )
        return self

    @model_validator(mode="after")
    def _target_fits_batch(self) -> DecodeConfig:
        a = self.autoscaling
        if a is not None and a.target_ongoing_requests > self.max_batch_size:
            raise ValueError(
                f"decode.autoscaling.target_ongoing_requests ({a.target_ongoing_requests:g}) "
                f"exceeds decode.max_batch_size ({self.max_batch_size}): streams would queue "
                "for a batch slot before the pool scales out; set the target to half to three "
                "quarters of max_batch_size"
            )
        return self


class KVConfig(_Frozen):
    block_size: int = Field(16, ge=1, le=1024, description="Tokens per KV block.")
    transport: Literal["auto", "nixl", "object_store"] = Field(
        "auto",
        description="How KV moves from prefill to decode: NIXL one-sided reads; the Ray object "
        "store (a slower fallback); or auto: NIXL when its start-up self-check passes, else the "
        "fallback (logged, and shown in /health).",
    )
    fabric: Literal["auto", "efa", "ib", "tcpx", "tcp"] = Field(
        "auto",
        description="The network KV crosses between nodes, which sets NIXL's backend and its "
        "environment (kvtransfer/fabric.py): efa (AWS p4d/p5: LIBFABRIC with the EFA "
        "provider), ib (InfiniBand or RoCE: UCX verbs, GPU memory registration), tcpx (GCP A3: "
        "no NIXL backend exists, so UCX over TCP, said in the log), tcp; auto detects the "
        "node's devices. Variables the operator set are left alone.",
    )
    path_check: bool = Field(
        True,
        description="At start-up each replica measures its KV path: another process reads "
        "64 MiB from it over NIXL, and /health shows the bandwidth and the transport UCX chose "
        "(a TCP path shows as emulated reads). Disaggregated, each ingress replica also has a "
        "decode replica read a prefill replica's probe (/health: kv_path_cross_pool).",
    )
    min_path_gbps: float = Field(
        0.0,
        ge=0,
        description="Below this the path check reports the pool degraded in /health, naming the "
        "transport (0: never). Set it on a cluster to what the fabric should give (e.g. 5).",
    )
    failure_policy: Literal["recompute", "fail"] = Field(
        "recompute",
        description="When a KV pull fails (prefill replica gone, lease expired, timeout): "
        "compute the prompt on decode instead, or end the request with a 503 error.",
    )
    pull_timeout_s: float = Field(
        10.0,
        gt=0,
        description="A KV pull running longer has failed. Prefill keeps an expired lease's "
        "blocks this long plus a second before reusing them, so a read decode started just "
        "before the lease ended still lands on the prompt's KV.",
    )
    quarantine_timeout_s: float = Field(
        60.0,
        gt=0,
        description="Decode holds the blocks of a failed or cancelled pull whose read NIXL has "
        "not reported ended (it may still land) at most this long; then they are retired, "
        "never reused, and counted (retired_blocks in /health).",
    )
    degraded_fraction: float = Field(
        0.2,
        ge=0,
        le=1,
        description="/health reports the decode pool degraded (status 'degraded', still 200) "
        "when more than this share of its replicas' recent KV handoffs failed their pull "
        "(recomputed on decode, or ended under failure_policy fail).",
    )
    degraded_window: int = Field(
        64, ge=1, le=100_000, description="Recent handoffs per decode replica that share counts."
    )


PROXY_TIMEOUT_MARGIN_S = 5.0


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
    grpc: GrpcConfig = Field(default_factory=GrpcConfig, description="gRPC endpoint.")
    ingress: IngressConfig = Field(
        default_factory=IngressConfig, description="The ingress deployment's replicas."
    )
    logging: LogConfig = Field(default_factory=LogConfig, description="Replicas' logs.")
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
    def _goodput_scaling_has_its_model(self) -> TandemConfig:
        a = self.decode.autoscaling
        if a is None or a.policy != "goodput":
            return self
        if self.decode.routing_tpot_slo_s is None:
            raise ValueError(
                "decode.autoscaling.policy is goodput but decode.routing_tpot_slo_s is not set: "
                "each replica's capacity is counted within that TPOT SLO (seconds, e.g. 0.05)"
            )
        if not (self.draft.adaptive and self.draft.kind != "none"):
            raise ValueError(
                "decode.autoscaling.policy is goodput but speculation is not adaptive "
                f"(draft.kind={self.draft.kind}, draft.adaptive={self.draft.adaptive}): a "
                "replica's capacity comes from adaptive speculation's measured step time; set "
                "draft.adaptive: true with a drafter, or policy: requests"
            )
        return self

    @model_validator(mode="after")
    def _object_store_is_tp1(self) -> TandemConfig:
        pools = [("decode", self.decode)] + (
            [("prefill", self.prefill)] if self.mode == "disaggregated" else []
        )
        for name, pool in pools:
            if self.kv.transport == "object_store" and pool.tp > 1:
                raise ValueError(
                    f"kv.transport=object_store moves KV between single ranks only; "
                    f"{name}.tp is {pool.tp}: use kv.transport nixl (or auto) with TP"
                )
        return self

    @model_validator(mode="after")
    def _fp8_on_gpus(self) -> TandemConfig:
        pools = [("decode", self.decode)] + (
            [("prefill", self.prefill)] if self.mode == "disaggregated" else []
        )
        for what, quant in (("model", self.model.quantization), ("draft", self.draft.quantization)):
            for name, pool in pools:
                if quant == "fp8" and pool.device == "cpu":
                    raise ValueError(
                        f"{what}.quantization=fp8 needs a GPU of compute capability >= 8.9; "
                        f"{name}.device is cpu (int8 serves on CPUs)"
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
        data = self.model_dump(exclude_unset=True)
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
        if self.http.ingress_resource:
            res[self.http.ingress_resource] = 1.0
        return res

    def ingress_replicas(self) -> int:
        """The ingress's replica count: as set, else one per ``limits.max_inflight`` streams the
        decode pool can run at once (so it never caps the cluster below decode), at least one."""
        if self.ingress.replicas is not None:
            return self.ingress.replicas
        streams = self.decode.most_replicas() * self.decode.max_batch_size
        return max(1, -(-streams // self.limits.max_inflight))

    def ingress_scaling(self) -> dict[str, Any]:
        """``serve.deployment`` sizing of the ingress (fixed count or autoscaling)."""
        return serve_scaling(self.ingress_replicas(), self.ingress.autoscaling)

    def proxy_timeout_s(self) -> float:
        """Serve's proxies' own request timeout: ours plus a margin, a backstop that never
        preempts the ingress's (which cancels the request everywhere and says why)."""
        return self.limits.request_timeout_s + PROXY_TIMEOUT_MARGIN_S

    def http_options(self) -> dict[str, Any]:
        """Ray Serve's ``http_options`` for this app."""
        return {
            "host": self.http.host,
            "port": self.http.port,
            "request_timeout_s": self.proxy_timeout_s(),
        }

    def grpc_options(self) -> dict[str, Any] | None:
        """Ray Serve's ``grpc_options`` for this app (None with gRPC off)."""
        if not self.grpc.enabled:
            return None
        return {
            "port": self.grpc.port,
            "grpc_servicer_functions": list(GRPC_SERVICER_FUNCTIONS),
            "request_timeout_s": self.proxy_timeout_s(),
        }
