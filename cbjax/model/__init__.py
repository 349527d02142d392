"""Llama-family model: NNX modules and the dense oracle; the old engine's paged prefill/decode."""

from cbjax.model.llama import DecoderLayer, Llama, check_supported, forward_dense, kv_cache_axes
from cbjax.model.paged import NULL_PAGE, KVCache, decode_step, init_cache, prefill

__all__ = [
    "NULL_PAGE",
    "DecoderLayer",
    "KVCache",
    "Llama",
    "check_supported",
    "decode_step",
    "forward_dense",
    "init_cache",
    "kv_cache_axes",
    "prefill",
]
