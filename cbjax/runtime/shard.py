"""How the step's arrays lie on a tensor-parallel mesh: the one mesh axis, the logical-axis
rules, and the in-step pieces (per-shard attention, output constraints) that the step and
`cbjax.runtime.mesh` share. Imports nothing of the step or the executor."""

from __future__ import annotations

from typing import Callable

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from cbjax.model.llama import kv_cache_axes

TENSOR = "tensor"
RULES = {"heads": TENSOR, "kv_heads": TENSOR, "mlp": TENSOR}


def spec(axes: tuple, ndim: int) -> P:
    """The PartitionSpec of an array of `ndim` dims whose trailing dims have logical `axes`
    (leading dims, like the stacked layers', are replicated)."""
    return P(*([None] * (ndim - len(axes))), *(RULES.get(a) for a in axes))


def cache_sharding(mesh: Mesh) -> NamedSharding:
    """The KV cache's sharding: split over kv heads."""
    return NamedSharding(mesh, spec(kv_cache_axes, len(kv_cache_axes)))


def shard_heads(attend: Callable, mesh: Mesh) -> Callable:
    """`attend(product, k_pages, v_pages, md, write_idx, layer_idx)` run per shard: the fused
    q/k/v product and the pages split on their head axis (1), the metadata replicated."""
    heads = P(None, TENSOR)
    return jax.shard_map(
        attend,
        mesh=mesh,
        in_specs=(heads, heads, heads, P(), P(), P()),
        out_specs=(heads, heads, heads),
        check_vma=False,  # no collective inside; the kernels' loop carries start unannotated
    )


def replicate(x: jax.Array, mesh: Mesh) -> jax.Array:
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, P()))


def constrain_cache(pages: jax.Array, mesh: Mesh) -> jax.Array:
    return jax.lax.with_sharding_constraint(pages, cache_sharding(mesh))
