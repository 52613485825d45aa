"""Attention over a paged KV cache, behind one interface (``backend.py``): the reference gather
path, flex_attention, and the device wings' kernels."""
