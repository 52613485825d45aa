"""The standard serving metrics, under vLLM's names and meanings (``tandem_`` prefixed), each
labelled with the served ``model_name`` as vLLM's are (``cluster/vllm_metrics.py`` also serves
them under vLLM's own names)."""

from __future__ import annotations

import time
from collections.abc import Sequence

LATENCY_BUCKETS = (
    0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75,
    1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip
PUBLISH_EVERY_S = 0.5


def _replica() -> str:
    try:
        from ray import serve

        return str(serve.get_replica_context().replica_id.unique_id)
    except Exception:  # not in a Serve replica (a test driving the class directly)
        return "local"


class RequestMetrics:
    def __init__(self, deployment: str = "ingress", model_name: str = "") -> None:
        from ray.util.metrics import Counter, Histogram

        tags = ("deployment", "replica", "model_name")
        self.tags = {"deployment": deployment, "replica": _replica(), "model_name": model_name}

        def hist(name: str, doc: str) -> Histogram:
            h = Histogram(name, doc, boundaries=list(LATENCY_BUCKETS), tag_keys=tags)
            h.set_default_tags(self.tags)
            return h

        def counter(name: str, doc: str, keys: Sequence[str] = tags) -> Counter:
            c = Counter(name, doc, tag_keys=tuple(keys))
            c.set_default_tags(self.tags)
            return c

        self.ttft = hist("tandem_time_to_first_token_seconds", "Time to the first token")
        self.itl = hist("tandem_inter_token_latency_seconds", "Time between output tokens")
        self.tpot = hist(
            "tandem_request_time_per_output_token_seconds",
            "A request's time per output token after the first",
        )
        self.e2e = hist("tandem_e2e_request_latency_seconds", "Request latency, end to end")
        self.prompt_tokens = counter("tandem_prompt_tokens_total", "Prompt tokens processed")
        self.generation_tokens = counter(
            "tandem_generation_tokens_total", "Output tokens generated"
        )
        self.success = counter(
            "tandem_request_success_total",
            "Requests finished, by finish reason",
            (*tags, "finished_reason"),
        )

    def start(self) -> RequestClock:
        return RequestClock(self, time.perf_counter())


class RequestClock:
    def __init__(self, metrics: RequestMetrics, t0: float) -> None:
        self.metrics = metrics
        self.t0 = t0
        self.first: float | None = None
        self.last = t0

    def tokens_arrived(self, n: int) -> None:
        if n <= 0:
            return
        now = time.perf_counter()
        if self.first is None:
            self.first = now
            self.metrics.ttft.observe(now - self.t0)
            n -= 1  # the first token has no gap before it
        if n > 0:
            gap = (now - self.last) / n
            for _ in range(n):
                self.metrics.itl.observe(gap)
        self.last = now

    def finished(self, reason: str, prompt_tokens: int, completion_tokens: int) -> None:
        m, now = self.metrics, time.perf_counter()
        m.e2e.observe(now - self.t0)
        if self.first is not None and completion_tokens > 1:
            m.tpot.observe((now - self.first) / (completion_tokens - 1))
        if prompt_tokens:  # 0 for a request's further choices: its prompt counts once
            m.prompt_tokens.inc(prompt_tokens)
        if completion_tokens:
            m.generation_tokens.inc(completion_tokens)
        m.success.inc(1, {**m.tags, "finished_reason": reason})


class ReplicaGauges:
    def __init__(self, deployment: str, model_name: str = "") -> None:
        from ray.util.metrics import Gauge, Histogram

        tags = ("deployment", "replica", "model_name")
        self.tags = {"deployment": deployment, "replica": _replica(), "model_name": model_name}
        self.running = Gauge("tandem_num_requests_running", "Requests decoding", tags)
        self.waiting = Gauge("tandem_num_requests_waiting", "Requests queued or pulling KV", tags)
        self.kv_usage = Gauge("tandem_kv_cache_usage_perc", "KV blocks in use (0 to 1)", tags)
        self.late_compiles = Gauge(
            "tandem_compiles_during_traffic",
            "Attention kernels compiled after start-up: steps that waited on a compile",
            tags,
        )
        self.late_captures = Gauge(
            "tandem_graph_captures_during_traffic",
            "CUDA graphs captured after start-up: steps that waited on a capture",
            tags,
        )
        self.queue_time = Histogram(
            "tandem_request_queue_time_seconds",
            "Time a request waited on the replica before it was admitted",
            boundaries=list(LATENCY_BUCKETS),
            tag_keys=tags,
        )
        gauges = (self.running, self.waiting, self.kv_usage, self.late_compiles, self.late_captures)
        for g in (*gauges, self.queue_time):
            g.set_default_tags(self.tags)
        self._published = 0.0

    def publish(
        self,
        running: int,
        waiting: int,
        used_fraction: float,
        queue_times: Sequence[float],
        during_traffic: tuple[int, int] = (0, 0),
        force: bool = False,
    ) -> None:
        """Observe the queue times; set the gauges (``during_traffic``: the compiles and
        captures steps waited on since start-up) if ``force`` (a request just ended) or none
        were set for ``PUBLISH_EVERY_S``."""
        for q in queue_times:
            self.queue_time.observe(q)
        now = time.monotonic()
        if not force and now - self._published < PUBLISH_EVERY_S:
            return
        self._published = now
        self.running.set(running)
        self.waiting.set(waiting)
        self.kv_usage.set(used_fraction)
        self.late_compiles.set(during_traffic[0])
        self.late_captures.set(during_traffic[1])
