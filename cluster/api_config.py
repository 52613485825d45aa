"""The API-facing part of the app config: where HTTP and gRPC bind, the ingress replicas
that serve them, request limits, API keys, and how every deployment logs."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from cluster.autoscaling import AutoscalingConfig


class Frozen(BaseModel):
    """Base of every config section: immutable, unknown keys refused."""

    model_config = ConfigDict(frozen=True, extra="forbid")


class HTTPConfig(Frozen):
    host: str = Field("127.0.0.1", description="Address the HTTP proxy binds to.")
    port: int = Field(8000, ge=1, le=65535, description="HTTP port.")
    ingress_resource: str | None = Field(
        None,
        description="A Ray custom resource the ingress replica needs (0.01 of it), to keep it "
        "on nodes that advertise it, e.g. the head, where the HTTP proxy runs; none: any node.",
    )


# registered by Ray Serve's gRPC proxy, which routes each RPC to the ingress method of its name
GRPC_SERVICER_FUNCTIONS = (
    "cluster.proto.tandem_pb2_grpc.add_TandemServicer_to_server",
    "grpc_health.v1.health_pb2_grpc.add_HealthServicer_to_server",
)


class GrpcConfig(Frozen):
    enabled: bool = Field(
        True,
        description="Serve the gRPC API (tandem.v1, cluster/proto/tandem.proto) and the standard "
        "health service through Ray Serve's gRPC proxy, with reflection on.",
    )
    port: int = Field(
        9000,
        ge=1,
        le=65535,
        description="gRPC port (Ray Serve's default). Ray Serve's gRPC proxy binds every "
        "interface; set API keys, or firewall it, where that matters.",
    )


class IngressConfig(Frozen):
    """The ingress deployment (tokenizing, validation, routing, both APIs); each replica has its
    own admission (``limits``), routers and counters."""

    replicas: int | None = Field(
        None,
        ge=1,
        description="Ingress replicas (a fixed count). Default: sized for the cluster, one per "
        "limits.max_inflight streams the decode pool can run at once (its most replicas times "
        "decode.max_batch_size), at least one.",
    )
    autoscaling: AutoscalingConfig | None = Field(
        None,
        description="Let Ray Serve scale the ingress between bounds instead; its load is the "
        "generations (streams) each replica carries, so target_ongoing_requests is a share "
        "of limits.max_inflight.",
    )
    max_ongoing_requests: int = Field(
        1024,
        ge=1,
        description="Requests (generations, health checks, tokenize calls) one ingress replica "
        "accepts at once (Ray Serve); generations are capped lower by limits.max_inflight.",
    )

    @model_validator(mode="after")
    def _one_sizing(self) -> IngressConfig:
        if self.autoscaling is not None and self.replicas is not None:
            raise ValueError(
                "set either ingress.replicas (a fixed count) or ingress.autoscaling, not both"
            )
        return self


class LogConfig(Frozen):
    """How every deployment's replicas log (Ray Serve's per-deployment ``logging_config``; tandem's
    loggers write through the same handlers)."""

    encoding: Literal["TEXT", "JSON"] = Field(
        "TEXT",
        description="JSON: one JSON object per line in the replicas' Serve logs, with "
        "request_id (the client's X-Request-Id, or the one Serve made for the request), "
        "deployment, replica and logger fields.",
    )
    level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = Field(
        "INFO", description="Lowest level logged, by Serve and by tandem's loggers."
    )
    requests: bool = Field(
        False,
        description="The ingress logs each generation as it starts (its internal id, prompt "
        "tokens, max_tokens, sampling) and as it ends (finish reason, tokens), at info level: "
        "the internal id is the one decode and prefill log lines name.",
    )
    access_log: bool = Field(
        True,
        description="A line per request per deployment (ingress, prefill, decode), each with "
        "the request id: the trail of one request across the pools.",
    )

    def serve_options(self) -> dict[str, object]:
        return {
            "encoding": self.encoding,
            "log_level": self.level,
            "enable_access_log": self.access_log,
        }


class LimitsConfig(Frozen):
    max_model_len: int | None = Field(
        None, ge=2, description="Prompt plus output tokens per request; default: the model's."
    )
    default_max_tokens: int = Field(
        256, ge=1, description="max_tokens of a chat request that does not set it."
    )
    max_stop_sequences: int = Field(4, ge=0, description="Stop strings a request may give.")
    max_choices: int = Field(
        16,
        ge=1,
        le=128,
        description="Most choices (n) one request may ask for. The choices share one prefill "
        "and their prompt's KV blocks on decode, but each is a sequence in the decode batch.",
    )
    max_tokens: int | None = Field(
        None, ge=1, description="Most tokens one request may ask for; default: what fits."
    )
    max_body_bytes: int = Field(
        1_048_576, ge=1024, description="Largest request body; larger ones get 413."
    )
    request_timeout_s: float = Field(
        600.0,
        gt=0,
        description="Most seconds one request may take end to end (queueing, prefill, every "
        "token); past it the request is cancelled everywhere, its KV freed, and the client "
        "gets 504 (or an error event on a stream). Ray Serve's proxies get it plus 5 s.",
    )
    body_timeout_s: float = Field(
        30.0,
        gt=0,
        description="Most seconds a client may take to send its request body; a slower one "
        "gets 408 and its admission slot back.",
    )
    max_inflight: int = Field(
        256,
        ge=1,
        description="Generation requests one ingress replica serves at once (the cluster "
        "serves this times the ingress replicas); more get 429 with Retry-After at once "
        "instead of queueing.",
    )
    max_concurrent_per_key: int = Field(
        0,
        ge=0,
        description="Generation requests one API key may have open at once on one ingress "
        "replica (0: no cap).",
    )
    retries: int = Field(
        1,
        ge=0,
        le=3,
        description="Times a request that has streamed no token yet is sent again after the "
        "replica serving it is lost (prefill died mid-prompt, decode died while the request was "
        "queued or pulling); the router then places it on another replica. 0: never.",
    )


class AuthConfig(Frozen):
    api_keys_file: str | None = Field(
        None, description="A file of API keys, one per line ('#' comments); none: no file."
    )
    api_keys_env: str = Field(
        "TANDEM_API_KEYS",
        description="An environment variable holding comma-separated API keys, read by the "
        "process that builds the app (on KubeRay, from a Secret: deploy/kuberay).",
    )
    required: bool = Field(
        True,
        description="Refuse to start without at least one API key, rather than serve an open "
        "API. false only for a server on loopback (deploy/local.yaml, `make serve`).",
    )
    shared_cache: bool = Field(
        False,
        description="Let requests of different API keys share cached prompt KV and prefix "
        "affinity. Off, each key's prefixes are cached apart (like vLLM's cache_salt), so the "
        "time to a first token cannot tell one tenant whether another sent a prompt.",
    )
