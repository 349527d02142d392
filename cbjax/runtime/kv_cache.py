"""The paged KV cache on the device: one page array per layer for K and one for V."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from cbjax.model.ops import write_layer  # noqa: F401  the XLA K/V write, public here too

# Writes that belong to no sequence (padding tokens) land here; never read.
NULL_PAGE = 0


@functools.partial(jax.tree_util.register_dataclass, data_fields=["k", "v"], meta_fields=[])
@dataclasses.dataclass(frozen=True)
class KVCache:
    """K and V pages for every layer, in the `cbjax.kernels.metadata` layout per layer."""

    k: jax.Array  # [num_layers, num_kv_heads, num_pages, page_size, head_dim]
    v: jax.Array  # [num_layers, num_kv_heads, num_pages, page_size, head_dim]

    @property
    def num_pages(self) -> int:
        return self.k.shape[2]

    @property
    def page_size(self) -> int:
        return self.k.shape[3]


def init_cache(num_layers: int, num_kv_heads: int, head_dim: int, num_pages: int, page_size: int, dtype) -> KVCache:
    """A zeroed cache. Page 0 is the null page, so num_pages - 1 are usable."""
    if num_pages < 2 or page_size < 1:
        raise ValueError(f"init_cache: need num_pages >= 2 and page_size >= 1, got {num_pages}, {page_size}")
    shape = (num_layers, num_kv_heads, num_pages, page_size, head_dim)
    return KVCache(k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype))
