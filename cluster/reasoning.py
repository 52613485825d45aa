"""Reasoning parsers: ``<think>...</think>`` (Qwen3, DeepSeek-R1 and their kin) split into
``reasoning_content`` and ``content``, also in a stream (a tag cut across two deltas is held back
until it is whole)."""

from __future__ import annotations

OPEN, CLOSE = "<think>", "</think>"


def detect_reasoning(template: str) -> str | None:
    return "think" if CLOSE in template else None


def opens_thinking(prompt_text: str) -> bool:
    """The rendered prompt ends inside an open ``<think>`` (R1-style templates, Qwen3 thinking
    forced on): the output starts as reasoning, with no opening tag of its own."""
    tail = prompt_text.rstrip()
    return tail.endswith(OPEN)


class ThinkStream:
    def __init__(self, starts_inside: bool) -> None:
        # before: the output may still open with <think>; inside; after: plain content
        self.state = "inside" if starts_inside else "before"
        self.pending = ""

    def push(self, text: str) -> tuple[str, str]:
        """(reasoning, content) safe to send."""
        self.pending += text
        reasoning = content = ""
        while True:
            if self.state == "before":
                lead = self.pending.lstrip()
                if lead.startswith(OPEN):
                    self.pending, self.state = lead[len(OPEN) :], "inside"
                    continue
                if OPEN.startswith(lead):  # could still become the tag
                    return reasoning, content
                self.state = "after"
            if self.state == "inside":
                i = self.pending.find(CLOSE)
                if i < 0:
                    keep = _tail_prefix(self.pending, CLOSE)
                    cut = len(self.pending) - keep
                    reasoning += self.pending[:cut]
                    self.pending = self.pending[cut:]
                    return reasoning, content
                reasoning += self.pending[:i]
                self.pending, self.state = self.pending[i + len(CLOSE) :], "after"
                continue
            content += self.pending
            self.pending = ""
            return reasoning, content

    def finish(self) -> tuple[str, str]:
        rest, self.pending = self.pending, ""
        if self.state == "inside":
            return rest, ""
        return "", rest


def _tail_prefix(text: str, tag: str) -> int:
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0
