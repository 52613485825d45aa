"""The one ``Request`` object that flows from ingress through prefill to decode.

It carries what the client asked for (prompt token ids, sampling parameters) and, once an
engine owns it, that engine's view of its progress. Engines schedule by counters — how many
tokens each model has computed into the KV cache versus how many tokens are known — never by
phase flags: a request whose KV came from a prefill replica simply starts with its counters at
the prompt length.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field, replace

from models.sampling import SamplingParams, choice_seed


class RequestStatus(enum.Enum):
    WAITING = "waiting"  # admitted, no KV yet: the prompt will be computed locally
    WAITING_FOR_KV = "waiting_for_kv"  # the prompt's KV is being pulled from a prefill replica
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(enum.Enum):
    STOP = "stop"  # an end-of-sequence or stop token
    LENGTH = "length"  # max_tokens or the context limit
    ABORT = "abort"  # cancelled by the client
    ERROR = "error"  # the engine could not continue (the error text says why)


@dataclass
class AcceptanceStats:
    """Speculation outcomes of one request."""

    num_steps: int = 0  # verification steps that tested at least one draft token
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_emitted_tokens: int = 0  # tokens those steps produced (accepted plus recovered/bonus)

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
    """A generation request and an engine's progress on it (each process holds its own copy)."""

    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    arrival_time: float = field(default_factory=time.time)
    output_token_ids: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    num_computed: int = 0  # tokens whose target KV is in this engine's cache
    num_draft_computed: int = 0  # tokens whose draft KV is in this engine's cache
    block_table: list[int] = field(default_factory=list)
    # target KV slot copies (src, dst) owed to the cache: a path accepted from a draft tree,
    # compacted at the start of the request's next step (models.tree)
    kv_moves: tuple[tuple[int, int], ...] = ()
    acceptance_estimate: float | None = None  # calibrated probe at first, refined by decode
    acceptance_probe: float | None = None  # prefill's probe as measured (None: none ran)
    calibration_key: tuple[int, int] | None = None  # speculation.calibration cell, once started
    start_estimate: float | None = None  # its cell's calibrated estimate when it started
    stats: AcceptanceStats = field(default_factory=AcceptanceStats)
    stalled_preemptions: int = 0  # preemptions in a row with no output token since the last
    outputs_at_preemption: int = -1  # len(output_token_ids) when last preempted (or first run)
    finish_reason: FinishReason | None = None
    error: str | None = None
    choice: int = 0  # which of the client's ``sampling.n`` choices this sequence generates

    def choices(self) -> list[Request]:
        """The request's further choices (1 .. n - 1), each a sequence of its own over the same
        prompt with its own seed (``models.sampling.choice_seed``), not yet started."""
        sp = self.sampling
        return [
            Request(
                request_id=choice_id(self.request_id, i),
                prompt_token_ids=self.prompt_token_ids,  # shared, never written
                sampling=replace(sp, n=1, seed=choice_seed(sp.seed, i)),
                arrival_time=self.arrival_time,
                choice=i,
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
        """``all_token_ids[start:stop]`` without copying the whole sequence."""
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
    """The id of choice ``choice`` of request ``request_id`` (choice 0 keeps the request's)."""
    return request_id if choice == 0 else f"{request_id}/{choice}"
