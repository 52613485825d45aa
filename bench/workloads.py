"""What a load run sends and when: ShareGPT or synthetic requests, and Poisson arrival times.

Token counts here are estimates (about four characters of English per token), as the client
does not load the server's tokenizer; the server's ``usage`` gives the real counts afterwards.
"""

from __future__ import annotations

import itertools
import math
import random
from collections.abc import Iterable
from dataclasses import dataclass

from bench.copy_prompts import COPY_PROMPTS
from bench.sharegpt import Conversation

CHARS_PER_TOKEN = 4.0
# Common one-token English words, for synthetic prompts of a roughly known token length.
_WORD_TEXT = (
    "the of and to in is was for on are with as his they be at one have this from or had by "
    "word but what some we can out other were all there when up use your how said an each she "
    "which do their time if will way about many then them write would like so these her long "
    "make thing see him two has look more day could go come did number sound no most people my "
    "over know water than call first who may down side been now find any new work part take get "
    "place made live where after back little only round man year came show every good me give "
    "our under name very through just form sentence great think say help low line differ turn"
)
WORDS: tuple[str, ...] = tuple(_WORD_TEXT.split())


@dataclass(frozen=True)
class WorkItem:
    """One request to send: its workload class, the user message, and its max_tokens."""

    kind: str  # "sharegpt", "synthetic", "copy" or "creative"
    prompt: str
    max_tokens: int
    temperature: float | None = None  # None: the run's --temperature


def approx_tokens(text: str) -> int:
    """A rough token count of English text (at least 1)."""
    return max(1, math.ceil(len(text) / CHARS_PER_TOKEN))


def first_exchange(conv: Conversation) -> tuple[str, str] | None:
    """The first human turn and the gpt answer right after it, if the conversation has both."""
    for (who, text), (next_who, answer) in itertools.pairwise(conv.turns):
        if who == "human":
            return (text, answer) if next_who == "gpt" else None
    return None


def sharegpt_items(
    conversations: Iterable[Conversation],
    n: int,
    seed: int,
    max_tokens_cap: int | None = None,
    max_prompt_tokens: int = 1024,
    max_total_tokens: int = 2048,
) -> list[WorkItem]:
    """``n`` conversations sampled with ``seed`` (fewer if fewer qualify), filtered as vLLM's
    benchmark_serving does: prompt and answer of at least 4 tokens, prompt of at most
    ``max_prompt_tokens``, both together at most ``max_total_tokens``. max_tokens is the
    recorded answer's length, capped by ``max_tokens_cap``."""
    eligible: list[tuple[str, int]] = []
    for conv in conversations:
        pair = first_exchange(conv)
        if pair is None:
            continue
        prompt, answer = pair
        p, o = approx_tokens(prompt), approx_tokens(answer)
        if p < 4 or o < 4 or p > max_prompt_tokens or p + o > max_total_tokens:
            continue
        eligible.append((prompt, o))
    chosen = random.Random(seed).sample(eligible, min(n, len(eligible)))
    cap = max_tokens_cap or max_total_tokens
    return [WorkItem("sharegpt", prompt, min(o, cap)) for prompt, o in chosen]


def _length(rng: random.Random, mean: int, range_ratio: float) -> int:
    lo = max(1, round(mean * (1.0 - range_ratio)))
    hi = max(lo, round(mean * (1.0 + range_ratio)))
    return rng.randint(lo, hi)


def synthetic_items(
    n: int,
    input_len: int,
    output_len: int,
    range_ratio: float,
    copy_fraction: float,
    seed: int,
) -> list[WorkItem]:
    """``n`` requests: a ``copy_fraction`` of copy-heavy prompts (``bench/copy_prompts.py``),
    the rest random words of about ``input_len`` tokens. Lengths are uniform in
    ``[len * (1 - range_ratio), len * (1 + range_ratio)]``; ``range_ratio=0`` fixes them."""
    if not 0.0 <= range_ratio < 1.0:
        raise ValueError(f"range_ratio must be in [0, 1), got {range_ratio}")
    if not 0.0 <= copy_fraction <= 1.0:
        raise ValueError(f"copy_fraction must be in [0, 1], got {copy_fraction}")
    rng = random.Random(seed)
    items: list[WorkItem] = []
    for _ in range(n):
        out = _length(rng, output_len, range_ratio)
        if rng.random() < copy_fraction:
            items.append(WorkItem("copy", rng.choice(COPY_PROMPTS), out))
        else:
            words = rng.choices(WORDS, k=_length(rng, input_len, range_ratio))
            items.append(WorkItem("synthetic", " ".join(words), out))
    return items


CREATIVE_PROMPTS: tuple[str, ...] = (
    "Write a short story about a lighthouse keeper who finds a door in the sea.",
    "Invent a new festival for a city on the moon and describe how it is celebrated.",
    "Write a poem about the smell of rain on hot stone.",
    "Describe an imaginary animal that lives in clouds, and its daily life.",
    "Tell a fable about a clock that wanted to stop time.",
    "Write the opening scene of a mystery set in a floating market.",
)


def bimodal_items(n: int, output_len: int, seed: int) -> list[WorkItem]:
    """``n`` requests, alternating copy-heavy prompts sent greedy (prompt lookup accepts most
    of its drafts) and open creative prompts sampled at temperature 1 (it accepts few)."""
    rng = random.Random(seed)
    return [
        WorkItem("copy", rng.choice(COPY_PROMPTS), output_len, 0.0)
        if i % 2 == 0
        else WorkItem("creative", rng.choice(CREATIVE_PROMPTS), output_len, 1.0)
        for i in range(n)
    ]


def poisson_offsets(n: int, rate: float, seed: int) -> list[float]:
    """Send times (seconds from the start) of ``n`` requests arriving as a Poisson process of
    ``rate`` per second: the first at 0, then exponential gaps. ``rate=inf`` sends all at 0."""
    if rate <= 0:
        raise ValueError(f"request rate must be positive, got {rate}")
    if math.isinf(rate):
        return [0.0] * n
    rng = random.Random(seed)
    offsets, t = [], 0.0
    for i in range(n):
        if i:
            t += rng.expovariate(rate)
        offsets.append(t)
    return offsets
