"""Llama-family model: functional params, dense oracle, and paged-cache prefill/decode."""

from cbjax.model.llama import Params, forward_dense, init_params
from cbjax.model.paged import NULL_PAGE, KVCache, decode_step, init_cache, prefill

__all__ = [
    "NULL_PAGE",
    "KVCache",
    "Params",
    "decode_step",
    "forward_dense",
    "init_cache",
    "init_params",
    "prefill",
]
