"""ShareGPT V3 conversations: the reader lives in ``distill.sharegpt`` (distillation uses it
too, and packages never import ``bench``); re-exported here for the benchmarks."""

from distill.sharegpt import (
    Conversation,
    dataset_path,
    first_prompts,
    held_out,
    iter_conversations,
)

__all__ = ["Conversation", "dataset_path", "first_prompts", "held_out", "iter_conversations"]
