"""The math: a Llama-family transformer over a paged KV cache (no Ray, no ``kvtransfer``)."""
