"""Llama-family model: Flax NNX modules and the dense, cache-free oracle."""

from cbjax.model.llama import DecoderLayer, Llama, check_supported, forward_dense, kv_cache_axes

__all__ = ["DecoderLayer", "Llama", "check_supported", "forward_dense", "kv_cache_axes"]
