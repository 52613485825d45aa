"""KV memory and its movement: block pools, the block allocator, handoffs, transports, leases.

This package knows nothing of HTTP or scheduling. It is imported by the prefill and decode
workers, which wire its pool tensors into the model's forward.
"""
