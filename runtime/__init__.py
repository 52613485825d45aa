"""Running models on one worker: shards, the TP group, one step over a paged KV cache."""
