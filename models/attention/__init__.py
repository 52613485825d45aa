"""Attention over a paged KV cache, behind one interface (``backend.py``)."""
