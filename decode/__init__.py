"""Decode: continuous batching, drafters, speculative verification, the decode deployment."""
