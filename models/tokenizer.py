"""Tokenizer wrapper: encoding, the chat template, and incremental detokenization for streams."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


class Tokenizer:
    """An HF tokenizer loaded from a local folder, with the few operations serving needs."""

    def __init__(self, folder: Path) -> None:
        from transformers import AutoTokenizer

        self._tok: Any = AutoTokenizer.from_pretrained(str(folder))
        self.folder = folder

    @property
    def vocab_size(self) -> int:
        """Number of distinct token ids, added tokens included."""
        return len(self._tok)

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        eos = self._tok.eos_token_id
        return () if eos is None else (int(eos),)

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self._tok, "chat_template", None))

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False))

    def apply_chat_template(
        self, messages: Sequence[dict[str, str]], add_generation_prompt: bool = True
    ) -> list[int]:
        """Token ids of ``messages`` under the model's chat template; with the assistant header
        appended (a prompt) unless ``add_generation_prompt`` is False (a finished transcript)."""
        if not self.has_chat_template:
            raise ValueError("this model's tokenizer has no chat template; use /v1/completions")
        out = self._tok.apply_chat_template(
            list(messages), add_generation_prompt=add_generation_prompt, tokenize=True
        )
        ids = out["input_ids"] if hasattr(out, "keys") else out
        return [int(i) for i in ids]

    def decode(self, ids: Sequence[int]) -> str:
        return str(self._tok.decode(list(ids), skip_special_tokens=True))

    def vocabulary(self) -> dict[str, int]:
        return dict(self._tok.get_vocab())


@dataclass
class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas without splitting UTF-8 characters.

    Each call to :meth:`push` decodes the ids seen so far and returns the text not yet emitted,
    holding back a trailing replacement character until the next token completes it.
    """

    tokenizer: Tokenizer
    ids: list[int] = field(default_factory=list)
    emitted: str = ""

    def push(self, new_ids: Sequence[int]) -> str:
        self.ids.extend(new_ids)
        text = self.tokenizer.decode(self.ids)
        if text.endswith("\ufffd"):
            return ""
        delta = text[len(self.emitted) :] if text.startswith(self.emitted) else ""
        self.emitted = text if text.startswith(self.emitted) else self.emitted
        return delta

    def flush(self) -> str:
        text = self.tokenizer.decode(self.ids)
        delta = text[len(self.emitted) :] if text.startswith(self.emitted) else ""
        self.emitted += delta
        return delta
