"""Wires the deployments of a tandem app from a ``TandemConfig`` (behaviour lives elsewhere)."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ray import serve
from ray.serve import Application

from cluster.auth import required_keys
from cluster.config import PoolConfig, TandemConfig
from cluster.guard import GuardPolicy
from cluster.ingress import OpenAIIngress
from cluster.routing.deploy import decode_router_options, prefill_router_options
from cluster.service import ServiceSettings
from decode.config import DecodeEngineConfig
from decode.server import DecodeServer
from models.config import LlamaConfig
from models.embedded import EMBEDDED_NAME, embedded_eagle_path
from models.spec import DraftKind, DraftSpec, ModelSpec, served_dtype
from models.weights import resolve_checkpoint
from prefill.config import PrefillWorkerConfig
from prefill.server import PrefillServer
from serving.health_board import board_actor_config

log = logging.getLogger(__name__)


class DraftMismatchError(ValueError):
    """The draft model cannot draft for the target (different tokenizer)."""


@dataclass(frozen=True)
class ResolvedModels:
    name: str
    target: ModelSpec
    draft: DraftSpec
    max_model_len: int


def _device(pool: PoolConfig) -> str:
    if pool.device != "auto":
        return pool.device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def check_draft_vocab(target_folder: Path, draft_folder: Path) -> None:
    """A draft must share the target's tokenizer: same vocabulary, token for token."""
    from models.tokenizer import Tokenizer

    tv, dv = Tokenizer(target_folder).vocabulary(), Tokenizer(draft_folder).vocabulary()
    if tv != dv:
        differing = len(set(tv.items()) ^ set(dv.items()))
        raise DraftMismatchError(
            f"draft vocabulary ({draft_folder}: {len(dv)} tokens) differs from target vocabulary "
            f"({target_folder}: {len(tv)} tokens) in {differing} entries; a draft model must "
            "share the target's tokenizer"
        )


def check_eagle_head(target_folder: Path, head_folder: Path) -> None:
    """An EAGLE head must be sized for the target: its features and vocabulary."""
    from models.eagle import EagleConfig

    if not (head_folder / "config.json").exists():
        raise FileNotFoundError(f"EAGLE head folder {head_folder} has no config.json")
    head, target = EagleConfig.from_folder(head_folder), LlamaConfig.from_folder(target_folder)
    if (head.layer.hidden_size, head.vocab_size) != (target.hidden_size, target.vocab_size):
        raise DraftMismatchError(
            f"EAGLE head {head_folder} has hidden size {head.layer.hidden_size} and vocabulary "
            f"{head.vocab_size}; target {target_folder} has {target.hidden_size} and "
            f"{target.vocab_size}"
        )


def resolve_models(cfg: TandemConfig) -> ResolvedModels:
    folder = resolve_checkpoint(cfg.model.source)
    name = cfg.model.name or (EMBEDDED_NAME if cfg.model.source == "embedded" else folder.name)
    device = _device(cfg.decode)
    dtype = served_dtype(cfg.model.dtype, folder, device)
    target = ModelSpec(str(folder), dtype, cfg.model.quantization)
    d = cfg.draft
    draft_model = None
    if d.kind == "draft_model":
        assert d.source is not None
        draft_folder = resolve_checkpoint(d.source)
        check_draft_vocab(folder, draft_folder)
        draft_dtype = served_dtype(d.dtype, draft_folder, device)
        draft_model = ModelSpec(str(draft_folder), draft_dtype, d.quantization)
    elif d.kind == "eagle":
        assert d.source is not None
        head_folder = (
            embedded_eagle_path()
            if d.source == "embedded"
            else Path(d.source).expanduser().resolve()  # replicas may run elsewhere
        )
        check_eagle_head(folder, head_folder)
        head_dtype = dtype if d.dtype == "auto" else d.dtype  # auto: the target's features'
        draft_model = ModelSpec(str(head_folder), head_dtype, d.quantization)
    draft = DraftSpec(
        kind=DraftKind(d.kind),
        model=draft_model,
        num_speculative_tokens=d.num_speculative_tokens,
        adaptive=d.adaptive,
        ngram_max=d.ngram_max,
        ngram_min=d.ngram_min,
        lookup_first=d.lookup_first,
        tree_width=d.tree_width,
        early_stop=d.early_stop,
    )
    check_tp(folder, cfg.decode.tp, "decode")
    if cfg.mode == "disaggregated":
        check_tp(folder, cfg.prefill.tp, "prefill")
    model_len = LlamaConfig.from_folder(folder).max_position_embeddings
    max_len = min(cfg.limits.max_model_len or model_len, model_len)
    return ResolvedModels(name, target, draft, max_len)


def _options(pool: PoolConfig, name: str, cfg: TandemConfig) -> dict[str, Any]:
    """Serve options: pinned to the pool's resource; a TP group is one placement group whose
    bundle r holds rank r (the replica itself is rank 0), packed onto one node."""
    share = pool.gpu_fraction  # below 1 only with cuda and tp 1: replicas share a GPU
    unit: dict[str, float] = {pool.resource: share}
    actor: dict[str, Any] = {"num_cpus": 0, "resources": {pool.resource: share}}
    if pool.onednn_cache_capacity is not None:  # read when the libraries start: at spawn
        n = str(pool.onednn_cache_capacity)
        actor["runtime_env"] = {
            "env_vars": {"ONEDNN_PRIMITIVE_CACHE_CAPACITY": n, "LRU_CACHE_CAPACITY": n}
        }
    if pool.device == "cuda":  # Ray sets CUDA_VISIBLE_DEVICES only to GPUs it assigned
        actor["num_gpus"] = share
        unit["GPU"] = share
    opts: dict[str, Any] = {
        "name": name,
        **pool.scaling_options(),
        "max_ongoing_requests": pool.max_ongoing_requests,
        "max_queued_requests": pool.max_queued_requests,
        "graceful_shutdown_wait_loop_s": 1.0,
        "graceful_shutdown_timeout_s": pool.drain_timeout_s,
        "ray_actor_options": actor,
        "health_check_period_s": 5,
        "logging_config": cfg.logging.serve_options(),
        "deployment_actors": [board_actor_config()],  # every replica's stats, for /health
    }
    if pool.tp > 1:
        opts["placement_group_bundles"] = [dict(unit) for _ in range(pool.tp)]
        opts["placement_group_strategy"] = "STRICT_PACK"
    return opts


def checkpoint_time(folder: Path) -> int:
    """The model's ``created`` time in ``/v1/models``: when its checkpoint was written. Not the
    build's clock, so re-applying an unchanged config leaves the ingress replica alone."""
    return int((folder / "config.json").stat().st_mtime)


def ingress_drain_options(cfg: TandemConfig) -> dict[str, Any]:
    """Client streams pass through the ingress, so a redeploy must let it drain as long as the
    slowest pool behind it (Serve's default 20 s would cut streams decode may still finish)."""
    pools = [cfg.decode] + ([cfg.prefill] if cfg.mode == "disaggregated" else [])
    return {
        "graceful_shutdown_wait_loop_s": 1.0,
        "graceful_shutdown_timeout_s": max(p.drain_timeout_s for p in pools),
    }


def check_tp(folder: Path, tp: int, pool: str) -> None:
    """Heads must split evenly over the TP ranks."""
    c = LlamaConfig.from_folder(folder)
    for what, n in (("attention heads", c.num_heads), ("KV heads", c.num_kv_heads)):
        if n % tp:
            raise ValueError(f"{pool}.tp={tp} does not divide the model's {n} {what}")


def engine_configs(
    cfg: TandemConfig, m: ResolvedModels
) -> tuple[DecodeEngineConfig, PrefillWorkerConfig | None]:
    """The decode engine's and (disaggregated) the prefill worker's configs: the deployments'
    arguments, also what an in-process benchmark builds."""
    bs = cfg.kv.block_size
    engine = DecodeEngineConfig(
        model_name=m.name,
        target=m.target,
        draft=m.draft,
        device=_device(cfg.decode),
        tp_size=cfg.decode.tp,
        num_blocks=cfg.decode.num_blocks,
        gpu_memory_utilization=cfg.decode.gpu_memory_utilization,
        block_size=bs,
        max_batch_size=cfg.decode.max_batch_size,
        max_num_batched_tokens=cfg.decode.max_num_batched_tokens,
        max_model_len=m.max_model_len,
        transport=cfg.kv.transport,
        kv_fabric=cfg.kv.fabric,
        path_check=cfg.kv.path_check,
        min_path_gbps=cfg.kv.min_path_gbps,
        pull_timeout_s=cfg.kv.pull_timeout_s,
        quarantine_timeout_s=cfg.kv.quarantine_timeout_s,
        max_queue_wait_s=cfg.decode.max_queue_wait_s,
        watchdog_s=cfg.decode.watchdog_s,
        kv_failure_policy=cfg.kv.failure_policy,
        kv_health_window=cfg.kv.degraded_window,
        num_threads=cfg.decode.num_threads,
        switch_interval_s=cfg.decode.switch_interval_s,
        speculation_tpot_slo_s=cfg.decode.speculation_tpot_slo_s,
        speculation_tpot_slo_max_loss=cfg.decode.speculation_tpot_slo_max_loss,
        acceptance_alarm_ratio=cfg.decode.acceptance_alarm_ratio,
        acceptance_alarm_window_tokens=cfg.decode.acceptance_alarm_window_tokens,
        max_stalled_preemptions=cfg.decode.max_stalled_preemptions,
        stream_interval_s=cfg.decode.stream_interval_s,
        step_shapes=cfg.decode.step_shapes,
        warm_up=cfg.decode.warm_up,
        overlap=cfg.decode.overlap,
    )
    if cfg.mode != "disaggregated":
        return engine, None
    worker = PrefillWorkerConfig(
        model_name=m.name,
        target=m.target,
        draft=m.draft,
        device=_device(cfg.prefill),
        tp_size=cfg.prefill.tp,
        num_blocks=cfg.prefill.num_blocks,
        gpu_memory_utilization=cfg.prefill.gpu_memory_utilization,
        block_size=bs,
        probe_window=cfg.prefill.probe_window,
        lease_seconds=cfg.prefill.lease_seconds,
        lease_grace_s=cfg.kv.pull_timeout_s + 1.0,
        num_threads=cfg.prefill.num_threads,
        switch_interval_s=cfg.prefill.switch_interval_s,
        max_num_batched_tokens=cfg.prefill.max_num_batched_tokens,
        enable_prefix_caching=cfg.prefill.enable_prefix_caching,
        transport=cfg.kv.transport,
        kv_fabric=cfg.kv.fabric,
        path_check=cfg.kv.path_check,
        min_path_gbps=cfg.kv.min_path_gbps,
    )
    return engine, worker


def build_app(cfg: TandemConfig) -> Application:
    """The Serve application: ingress → (prefill) → decode, each pinned to its pool."""
    keys = required_keys(cfg.auth)  # first: a closed app with no key never starts
    m = resolve_models(cfg)
    bs = cfg.kv.block_size
    decode_tokens = cfg.decode.num_blocks * bs
    engine, worker = engine_configs(cfg, m)
    decode_opts = _options(cfg.decode, "decode", cfg) | decode_router_options(cfg.decode)
    decode = serve.deployment(**decode_opts)(DecodeServer).bind(
        engine, cfg.decode.routing_tpot_slo_s
    )
    prefill = None
    max_prompt = min(m.max_model_len - 1, decode_tokens - 2)  # room for one output token
    if worker is not None:
        prefill_opts = _options(cfg.prefill, "prefill", cfg) | prefill_router_options(
            cfg.prefill, bs
        )
        prefill = serve.deployment(**prefill_opts)(PrefillServer).bind(worker)
        max_prompt = min(max_prompt, cfg.prefill.num_blocks * bs)
    settings = ServiceSettings(
        model_name=m.name,
        model_folder=m.target.folder,
        mode=cfg.mode,
        max_model_len=m.max_model_len,
        max_prompt_tokens=max_prompt,
        max_sequence_tokens=decode_tokens - 1,
        default_max_tokens=cfg.limits.default_max_tokens,
        max_stop_sequences=cfg.limits.max_stop_sequences,
        max_choices=cfg.limits.max_choices,
        eos_token_ids=m.target.config().eos_token_ids,
        draft_kind=cfg.draft.kind,
        created=checkpoint_time(Path(m.target.folder)),
        guard=GuardPolicy(
            keys=keys,
            max_body_bytes=cfg.limits.max_body_bytes,
            body_timeout_s=cfg.limits.body_timeout_s,
            max_inflight=cfg.limits.max_inflight,
            max_concurrent_per_key=cfg.limits.max_concurrent_per_key,
        ),
        max_tokens=cfg.limits.max_tokens,
        degraded_fraction=cfg.kv.degraded_fraction,
        retries=cfg.limits.retries,
        log_requests=cfg.logging.requests,
        request_timeout_s=cfg.limits.request_timeout_s,
        shared_cache=cfg.auth.shared_cache,
        chat_template=_template_text(cfg.model.chat_template),
        tool_parser=cfg.model.tool_parser,
        reasoning_parser=cfg.model.reasoning_parser,
        path_check=cfg.kv.path_check and worker is not None,
    )
    where = {"resources": {cfg.http.ingress_resource: 0.01}} if cfg.http.ingress_resource else {}
    ingress = serve.deployment(
        name="ingress",
        **cfg.ingress_scaling(),
        max_ongoing_requests=cfg.ingress.max_ongoing_requests,
        ray_actor_options={"num_cpus": 0, **where},
        logging_config=cfg.logging.serve_options(),
        **ingress_drain_options(cfg),
    )(OpenAIIngress)
    app: Application = ingress.bind(settings, prefill, decode)
    return app


def _template_text(path: str | None) -> str | None:
    """Read once at build time: every ingress replica serves the same template."""
    if path is None:
        return None
    try:
        return Path(path).read_text()
    except OSError as e:
        raise ValueError(f"model.chat_template: cannot read {path}: {e}") from e


def app_builder(args: dict[str, Any]) -> Application:
    """Entry point of ``serve run`` / ``serve deploy``; ``args["config"]`` is a YAML path or the
    config itself as a mapping (as rendered Serve configs embed it); without it, the defaults."""
    unknown = sorted(set(args) - {"config"})
    if unknown:
        raise ValueError(f"unknown application args {unknown}: the only one is 'config'")
    source = args.get("config")
    if isinstance(source, dict):
        cfg = TandemConfig.model_validate(source)
    else:
        cfg = TandemConfig.from_yaml(source) if source else TandemConfig()
    return build_app(cfg)
