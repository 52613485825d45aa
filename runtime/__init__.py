"""Running models on one worker: each rank's shard of the target and the co-hosted drafter,
the tensor-parallel group (rank 0 in the replica, ranks 1.. as Ray actors), one forward step
over a paged KV cache, and the start-up timing of that step.

It knows nothing of HTTP, routing or scheduling policy: prefill and decode drive it.
"""
