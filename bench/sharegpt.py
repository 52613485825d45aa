"""ShareGPT V3 conversations: the reader lives in ``distill.sharegpt`` (distillation uses it
too, and packages never import ``bench``); re-exported here for the benchmarks, with the
prompts' token ids as the chat endpoint would render them."""

from collections.abc import Iterable

from distill.sharegpt import (
    Conversation,
    dataset_path,
    first_prompts,
    held_out,
    iter_conversations,
)
from models.tokenizer import Tokenizer

__all__ = [
    "Conversation",
    "chat_prompts",
    "dataset_path",
    "first_prompts",
    "held_out",
    "iter_conversations",
]


def chat_prompts(tok: Tokenizer, texts: Iterable[str]) -> list[list[int]]:
    """Each text as one user message under the model's chat template (token ids)."""
    return [tok.apply_chat_template([{"role": "user", "content": t}]) for t in texts]
