"""Grammars that constrain sampling (structured outputs, forced tool calls), through llguidance.

llguidance was chosen over xgrammar by measurement (``bench.grammar_libs``: lower p99 mask
time at batch 1 and 32, no compile step to cache, no triton dependency). A ``GrammarSpec`` is
what travels with a request; a ``GrammarCompiler`` (one per tokenizer, on each replica) turns
it into a validated grammar once (cached) and into a ``GrammarState`` per sequence, off the
engine thread. The state follows the sequence's emitted tokens and answers the next-token
masks at each position of a draft without committing to it."""

from __future__ import annotations

import functools
import json
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch

GrammarKind = Literal["json_schema", "regex", "lark", "choice"]
# whitespace between JSON tokens, bounded: an unbounded run would let a model pad forever
FLEXIBLE: dict[str, Any] = {"whitespace_pattern": r"[\x20\x0A\x0D\x09]{0,24}"}
COMPACT: dict[str, Any] = {
    "whitespace_flexible": False,
    "item_separator": ", ",
    "key_separator": ": ",
}


class GrammarError(ValueError):
    """The grammar is invalid; the message says why (the API turns it into a 400)."""


@dataclass(frozen=True)
class GrammarSpec:
    kind: GrammarKind
    source: str  # a JSON schema (as JSON text), a regex, a Lark grammar, or a JSON list of strings
    compact: bool = False  # JSON as json.dumps writes it (forced tool calls), no free whitespace


def _llguidance_source(spec: GrammarSpec) -> str:
    import llguidance

    if spec.kind == "json_schema":
        try:
            return str(
                llguidance.LLMatcher.grammar_from_json_schema(
                    spec.source,
                    defaults=COMPACT if spec.compact else FLEXIBLE,  # type: ignore[arg-type]
                )
            )
        except ValueError as e:
            raise GrammarError(f"invalid JSON schema: {e}") from e
    if spec.kind == "regex":
        return str(llguidance.LLMatcher.grammar_from_regex(spec.source))
    if spec.kind == "choice":
        options = json.loads(spec.source)
        alternatives = " | ".join(json.dumps(str(o)) for o in options)
        return str(llguidance.LLMatcher.grammar_from_lark(f"start: {alternatives}"))
    from llguidance.gbnf_to_lark import any_to_lark

    try:  # Lark as it is; GBNF (vLLM's xgrammar dialect) converted
        lark = any_to_lark(spec.source)
    except Exception as e:
        raise GrammarError(f"invalid grammar: {e}") from e
    return str(llguidance.LLMatcher.grammar_from_lark(lark))


class GrammarCompiler:
    """Validated grammars for one tokenizer, cached by spec; thread-safe."""

    def __init__(self, hf_tokenizer: Any, vocab_size: int, stop_ids: Sequence[int]) -> None:
        import llguidance.hf

        self.vocab_size = vocab_size
        self._tok = llguidance.hf.from_tokenizer(
            hf_tokenizer, n_vocab=vocab_size, eos_token=list(stop_ids) or None
        )
        self._lock = threading.Lock()
        self._cached = functools.lru_cache(maxsize=512)(self._validate)

    def _validate(self, spec: GrammarSpec) -> str:
        import llguidance

        grammar = _llguidance_source(spec)
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, self._tok)
        if is_error:
            raise GrammarError(messages[0] if messages else "invalid grammar")
        return grammar

    def compile(self, spec: GrammarSpec) -> str:
        """Raises ``GrammarError``; costs a validation once per spec."""
        with self._lock:
            return self._cached(spec)

    def state(self, spec: GrammarSpec) -> GrammarState:
        import llguidance

        matcher = llguidance.LLMatcher(self._tok, self.compile(spec), log_level=0)
        if matcher.is_error():
            raise GrammarError(matcher.get_error())
        return GrammarState(matcher, self.vocab_size)

    @property
    def cache_size(self) -> int:
        return int(self._cached.cache_info().currsize)


class GrammarState:
    """One sequence's place in its grammar: ``consumed`` of its output tokens are in it."""

    def __init__(self, matcher: Any, vocab_size: int) -> None:
        import llguidance.torch as lt

        self._m = matcher
        self._initial = matcher.deep_copy()
        self.vocab_size = vocab_size
        self.words = int(lt.get_bitmask_shape(1, vocab_size)[1])
        self.consumed = 0
        # masks after the output and each draft prefix asked this step: [words] int32 each
        self._masks: dict[tuple[int, ...], torch.Tensor] = {}

    def fresh(self) -> GrammarState:
        """The same grammar at its start (for another choice of the request)."""
        return GrammarState(self._initial.deep_copy(), self.vocab_size)

    def sync(self, output: Sequence[int]) -> None:
        """Consume the output tokens it has not seen (emitted ones are never rolled back)."""
        if len(output) == self.consumed:
            return
        for t in output[self.consumed :]:
            self._m.consume_token(int(t))
        self.consumed = len(output)
        self._masks.clear()

    @property
    def stopped(self) -> bool:
        """The grammar is complete and takes no more tokens (or it is in error)."""
        return bool(self._m.is_stopped())

    @property
    def error(self) -> str | None:
        return str(self._m.get_error()) if self._m.is_error() else None

    def masks(self, output: Sequence[int], ahead: Sequence[int]) -> torch.Tensor:
        """[len(ahead) + 1, words] int32 bitmasks: after ``output``, then after each prefix of
        ``ahead`` (drafts: tried, then rolled back). Past a draft the grammar refuses, every
        token is allowed: those positions are never reached (the refused draft is rejected)."""
        import llguidance.torch as lt

        self.sync(output)
        out = torch.full((len(ahead) + 1, self.words), -1, dtype=torch.int32)
        taken = 0
        for j in range(len(ahead) + 1):
            key = tuple(ahead[:j])
            row = self._masks.get(key)
            if row is None:  # a draft round and its verification ask the same prefixes
                lt.fill_next_token_bitmask(self._m, out, j)
                self._masks[key] = out[j].clone()
            else:
                out[j] = row
            if j == len(ahead) or self._m.try_consume_tokens([int(ahead[j])]) != 1:
                break
            taken += 1
            if self._m.is_stopped():  # the draft ended the grammar: nothing follows it
                break
        if taken:
            self._m.rollback(taken)
        return out
