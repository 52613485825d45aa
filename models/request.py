"""The one ``Request`` that flows from ingress through prefill to decode. Engines schedule by
counters (tokens in the KV cache against tokens known), never by phase flags."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field, replace

from models.grammar import GrammarState
from models.sampling import SamplingParams, choice_seed


class RequestStatus(enum.Enum):
    WAITING = "waiting"  # admitted, no KV yet: the prompt will be computed locally
    WAITING_FOR_KV = "waiting_for_kv"  # the prompt's KV is being pulled from a prefill replica
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(enum.Enum):
    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"
    ERROR = "error"


@dataclass
class AcceptanceStats:
    num_steps: int = 0  # verification steps that tested at least one draft token
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_emitted_tokens: int = 0
    histogram: list[int] = field(default_factory=list)  # steps by how many drafts they accepted

    def record_step(self, drafted: int, accepted: int, emitted: int) -> None:
        self.num_steps += 1
        self.num_draft_tokens += drafted
        self.num_accepted_tokens += accepted
        self.num_emitted_tokens += emitted
        self.histogram += [0] * (drafted + 1 - len(self.histogram))
        self.histogram[accepted] += 1

    @property
    def acceptance_rate(self) -> float | None:
        if self.num_draft_tokens == 0:
            return None
        return self.num_accepted_tokens / self.num_draft_tokens

    @property
    def mean_accepted_length(self) -> float | None:
        """Tokens emitted per verification step, the bonus or recovered token included."""
        if self.num_steps == 0:
            return None
        return self.num_emitted_tokens / self.num_steps


@dataclass
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    arrival_time: float = field(default_factory=time.time)
    output_token_ids: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    num_computed: int = 0  # tokens whose target KV is in this engine's cache
    num_draft_computed: int = 0  # tokens whose draft KV is in this engine's cache
    block_table: list[int] = field(default_factory=list)
    # slot copies (src, dst) compacting an accepted tree path, done at the next step's start
    kv_moves: tuple[tuple[int, int], ...] = ()
    acceptance_estimate: float | None = None  # calibrated probe at first, refined by decode
    acceptance_probe: float | None = None
    calibration_key: tuple[int, int] | None = None
    start_estimate: float | None = None
    stats: AcceptanceStats = field(default_factory=AcceptanceStats)
    stalled_preemptions: int = 0  # preemptions in a row with no output token since the last
    outputs_at_preemption: int = -1
    finish_reason: FinishReason | None = None
    error: str | None = None
    choice: int = 0
    # partitions prefix caches and affinity routing: requests see cached KV only of their salt
    cache_salt: str = ""
    # where its output is in its grammar; attached by the replica running it, never shipped
    grammar: GrammarState | None = None

    def choices(self) -> list[Request]:
        sp = self.sampling
        return [
            Request(
                request_id=choice_id(self.request_id, i),
                prompt_token_ids=self.prompt_token_ids,
                sampling=replace(sp, n=1, seed=choice_seed(sp.seed, i)),
                arrival_time=self.arrival_time,
                choice=i,
                grammar=self.grammar.fresh() if self.grammar is not None else None,
            )
            for i in range(1, sp.n)
        ]

    @property
    def num_tokens(self) -> int:
        """Tokens known: prompt plus outputs (the last output is not yet in the KV cache)."""
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_slice(self, start: int, stop: int) -> list[int]:
        n = len(self.prompt_token_ids)
        if stop <= n:
            return self.prompt_token_ids[start:stop]
        if start >= n:
            return self.output_token_ids[start - n : stop - n]
        return self.prompt_token_ids[start:] + self.output_token_ids[: stop - n]

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED


def choice_id(request_id: str, choice: int) -> str:
    return request_id if choice == 0 else f"{request_id}/{choice}"
