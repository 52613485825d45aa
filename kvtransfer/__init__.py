"""KV memory and its movement: pools, allocator, handoffs, transports (docs/structure.md)."""
