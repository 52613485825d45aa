"""ShareGPT V3 conversations: the reader lives in ``cluster.sharegpt`` (distillation uses it
too, and packages never import ``bench``); re-exported here for the benchmarks."""

from cluster.sharegpt import (
    Conversation,
    dataset_path,
    first_prompts,
    held_out,
    iter_conversations,
)

__all__ = ["Conversation", "dataset_path", "first_prompts", "held_out", "iter_conversations"]
