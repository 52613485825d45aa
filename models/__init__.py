"""The math: a Llama-family transformer over a paged KV cache, weights, tokenizers, sampling.

Nothing in this package imports Ray or ``kvtransfer``: cache tensors and block tables come in
as arguments, so every function here runs in a plain process on a CPU.
"""
