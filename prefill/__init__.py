"""The prefill worker and its Ray Serve deployment: prompts in, ``KVHandoff`` out."""
