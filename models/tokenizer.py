"""Tokenizer wrapper: encoding, the chat template, and incremental detokenization for streams."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any


class Tokenizer:
    def __init__(self, folder: Path) -> None:
        from transformers import AutoTokenizer

        self._tok: Any = AutoTokenizer.from_pretrained(str(folder))
        self.folder = folder
        self._byte_decoder: dict[str, int] | None = None

    @property
    def vocab_size(self) -> int:
        return len(self._tok)

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        eos = self._tok.eos_token_id
        return () if eos is None else (int(eos),)

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self._tok, "chat_template", None))

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=add_special_tokens))

    def render_chat(
        self,
        messages: Sequence[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: Sequence[dict[str, Any]] | None = None,
        continue_final_message: bool = False,
        extra: dict[str, Any] | None = None,
    ) -> str:
        """Raises ValueError when there is no template or it refuses the messages; ``extra``:
        more template variables (vLLM's chat_template_kwargs)."""
        from jinja2 import TemplateError

        if not self.has_chat_template:
            raise ValueError("this model's tokenizer has no chat template; use /v1/completions")
        try:
            text = self._tok.apply_chat_template(
                list(messages),
                tools=list(tools) if tools else None,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message,
                tokenize=False,
                **(extra or {}),
            )
        except TemplateError as e:
            raise ValueError(f"the model's chat template refused the messages: {e}") from e
        return str(text)

    def apply_chat_template(
        self, messages: Sequence[dict[str, Any]], add_generation_prompt: bool = True
    ) -> list[int]:
        return self.encode(self.render_chat(messages, add_generation_prompt))

    def set_chat_template(self, template: str) -> None:
        """Serve with this template instead of the checkpoint's (``model.chat_template``)."""
        self._tok.chat_template = template

    @property
    def chat_template(self) -> str:
        t = getattr(self._tok, "chat_template", None)
        return t if isinstance(t, str) else ""

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return str(self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens))

    def token_bytes(self, ids: Sequence[int]) -> list[bytes]:
        """The bytes each id adds to the text (byte-level pieces decoded; SentencePiece's "▁"
        and "<0xNN>" undone)."""
        if self._byte_decoder is None:
            import json

            from transformers.convert_slow_tokenizer import bytes_to_unicode

            decoder = json.loads(self.backend.to_str()).get("decoder") or {}
            kinds = {d.get("type") for d in decoder.get("decoders", [decoder])}
            self._byte_decoder = (
                {c: b for b, c in bytes_to_unicode().items()} if "ByteLevel" in kinds else {}
            )
        special = set(self._tok.all_special_ids)
        table = self._byte_decoder
        out: list[bytes] = []
        for i, p in zip(ids, self._tok.convert_ids_to_tokens(list(ids)), strict=True):
            piece = str(p)
            if i in special or (table and not all(c in table for c in piece)):
                out.append(piece.encode())
            elif table:
                out.append(bytes(table[c] for c in piece))
            elif len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
                out.append(bytes([int(piece[3:5], 16)]))
            else:
                out.append(piece.replace("\u2581", " ").encode())
        return out

    def token_strs(self, ids: Sequence[int]) -> list[str]:
        return [str(t) for t in self._tok.convert_ids_to_tokens(list(ids))]

    @property
    def hf(self) -> Any:
        """The transformers tokenizer (constrained-decoding libraries read its vocabulary)."""
        return self._tok

    @property
    def backend(self) -> Any:
        backend = getattr(self._tok, "backend_tokenizer", None)
        if backend is None:
            raise ValueError(
                f"the tokenizer in {self.folder} is not a fast (tokenizers) one: tandem "
                "needs tokenizer.json"
            )
        return backend

    def vocabulary(self) -> dict[str, int]:
        return dict(self._tok.get_vocab())


class IncrementalDetokenizer:
    """Token ids to text deltas without splitting UTF-8 characters, at a constant cost per token;
    ``flush``, once at the end, emits what the stream held back."""

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True) -> None:
        from tokenizers.decoders import DecodeStream

        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = []
        self._parts: list[str] = []
        self._backend = tokenizer.backend
        self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)

    @property
    def emitted(self) -> str:
        return "".join(self._parts)

    def push(self, new_ids: Sequence[int]) -> str:
        self.ids.extend(new_ids)
        if not new_ids:
            return ""
        delta = self._stream.step(self._backend, list(new_ids)) or ""
        if delta:
            self._parts.append(delta)
        return delta

    def flush(self) -> str:
        text, emitted = self.tokenizer.decode(self.ids, self.skip_special_tokens), self.emitted
        delta = text[len(emitted) :] if text.startswith(emitted) else ""
        if delta:
            self._parts.append(delta)
        return delta
