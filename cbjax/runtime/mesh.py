"""Tensor parallelism (`executor.mesh.tensor=N`): a one-axis device mesh, the weights and the KV
cache sharded by the model's logical axes, and the step compiled with explicit shardings.

Logical axes map to the mesh by `RULES`: "heads", "kv_heads" and "mlp" split over the
"tensor" axis, everything else (embeddings, LM head, norms) is replicated. Each layer then
runs Megatron-style: q/k/v (and the fused gate/up) are column-split, attention runs per
shard on its own heads inside `jax.shard_map` (`shard_heads`), and o_proj and down_proj
contract a split axis, so XLA ends each with one all-reduce of the [T, d_model] activations:
two per layer, the count `cbjax.sim.tp` charges. The fused qkv kernel groups each kv head
with its query heads (`DecoderLayer.fuse`), so splitting its kv_heads axis keeps every GQA
group on one shard. Host inputs are replicated.

Across hosts the mesh takes the same number of devices from every process, in process order.
"""

from __future__ import annotations

import functools
from typing import Callable

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from cbjax.config import ModelConfig
from cbjax.model.llama import kv_cache_axes
from cbjax.runtime.kv_cache import KVCache, init_cache
from cbjax.runtime.step import step_compiler_options, step_fn

TENSOR = "tensor"
RULES = {"heads": TENSOR, "kv_heads": TENSOR, "mlp": TENSOR}


def check_tensor_parallel(model: ModelConfig, tensor: int, num_devices: int) -> None:
    """One-line ValueErrors naming the fields when `tensor` can't split this model on these devices."""
    if tensor > num_devices:
        raise ValueError(f"executor.mesh.tensor={tensor} needs {tensor} devices, but only {num_devices} are visible")
    for key in ("num_kv_heads", "num_heads", "ffn_dim"):
        value = getattr(model, key)
        if value % tensor:
            raise ValueError(f"model.{key}={value} is not divisible by executor.mesh.tensor={tensor}")


def make_mesh(tensor: int) -> Mesh:
    """A ("tensor",) mesh of `tensor` devices: the first tensor / process_count of each process."""
    procs = jax.process_count()
    if tensor % procs:
        raise ValueError(
            f"executor.mesh.tensor={tensor} must be a multiple of distributed.num_processes={procs}"
        )
    per = tensor // procs
    devices = []
    for p in range(procs):
        local = [d for d in jax.devices() if d.process_index == p]
        if per > len(local):
            raise ValueError(
                f"executor.mesh.tensor={tensor} needs {per} devices per process, process {p} has {len(local)}"
            )
        devices += local[:per]
    return Mesh(np.array(devices), (TENSOR,))


def spec(axes: tuple, ndim: int) -> P:
    """The PartitionSpec of an array of `ndim` dims whose trailing dims have logical `axes`
    (leading dims, like the stacked layers', are replicated)."""
    return P(*([None] * (ndim - len(axes))), *(RULES.get(a) for a in axes))


def _is_var(x) -> bool:
    return isinstance(x, nnx.Variable)


def weight_shardings(weights, mesh: Mesh):
    """The weights' pytree with a NamedSharding in place of each array (from its Param's axes)."""
    variables, _ = jax.tree.flatten(weights, is_leaf=_is_var)
    arrays, treedef = jax.tree.flatten(weights)
    if len(variables) != len(arrays) or not all(_is_var(v) for v in variables):
        raise ValueError("weight_shardings: every weight must be one nnx.Param with logical axes")
    shardings = [NamedSharding(mesh, spec(v.get_metadata()["out_sharding"], a.ndim)) for v, a in zip(variables, arrays)]
    return jax.tree.unflatten(treedef, shardings)


def place(tree, shardings):
    """`tree`'s arrays as global arrays laid out by `shardings`: each process fills its own
    shards from its host copy (every process holds the same values)."""

    def put(x, sharding):
        host = np.asarray(x)
        return jax.make_array_from_callback(host.shape, sharding, lambda idx: host[idx])

    return jax.tree.map(put, tree, shardings)


def shard_heads(attend: Callable, mesh: Mesh) -> Callable:
    """`attend(q, k, v, k_pages, v_pages, md, write_idx, layer_idx)` run per shard: q, k, v
    and the pages split on their head axis (1), the metadata replicated."""
    heads = P(None, TENSOR)
    return jax.shard_map(
        attend,
        mesh=mesh,
        in_specs=(heads, heads, heads, heads, heads, P(), P(), P()),
        out_specs=(heads, heads, heads),
        check_vma=False,  # no collective inside; the kernels' loop carries start unannotated
    )


class TensorParallel:
    """The executor's sharded side: placement of weights, cache and batches, and the step jit."""

    def __init__(self, model: ModelConfig, tensor: int):
        check_tensor_parallel(model, tensor, jax.device_count())
        self.tensor = tensor
        self.mesh = make_mesh(tensor)
        self.replicated = NamedSharding(self.mesh, P())
        self.cache_sharding = NamedSharding(self.mesh, spec(kv_cache_axes, len(kv_cache_axes)))
        self._steps: dict[tuple, Callable] = {}

    def place_weights(self, weights):
        self.weight_shardings = weight_shardings(weights, self.mesh)
        return place(weights, self.weight_shardings)

    def init_cache(self, *args) -> KVCache:
        """`cbjax.runtime.kv_cache.init_cache(*args)` created sharded over kv heads (no one-device copy)."""
        shardings = KVCache(k=self.cache_sharding, v=self.cache_sharding)
        return jax.jit(functools.partial(init_cache, *args), out_shardings=shardings)()

    def to_global(self, tree):
        """Host arrays (the same on every process) as replicated global arrays."""
        if jax.process_count() == 1:
            return jax.device_put(tree, self.replicated)
        return jax.tree.map(lambda x: jax.make_array_from_process_local_data(self.replicated, np.asarray(x)), tree)

    def fetch(self, x: jax.Array) -> np.ndarray:
        """A replicated result on the host: this process's copy (others' devices are out of reach)."""
        return np.asarray(x.addressable_data(0))

    def step(self, graphdef, attention: str):
        """`step_fn` for this graphdef and attention backend, jitted once with explicit
        shardings: weights and cache as placed, the batch and the outputs (greedy tokens,
        logits) replicated, the cache donated. Called as step(weights, cache, batch)."""
        key = (graphdef, attention)
        if key not in self._steps:
            cache = KVCache(k=self.cache_sharding, v=self.cache_sharding)
            self._steps[key] = jax.jit(
                functools.partial(step_fn, graphdef=graphdef, attention=attention, mesh=self.mesh),
                donate_argnums=(1,),
                in_shardings=(self.weight_shardings, cache, self.replicated),
                out_shardings=(self.replicated, self.replicated, cache),
                compiler_options=step_compiler_options(self.mesh.devices.flat[0].platform),
            )
        return self._steps[key]
