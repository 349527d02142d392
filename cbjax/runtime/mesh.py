"""Tensor parallelism (`executor.mesh.tensor=N`): a one-axis device mesh, the weights and the KV
cache sharded by the model's logical axes; the step (`cbjax.runtime.step.model_step`, the one jit)
takes its shardings from how they are placed.

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

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from cbjax.config import ModelConfig
from cbjax.runtime.kv_cache import KVCache, init_cache
from cbjax.runtime.shard import TENSOR, cache_sharding, spec
from cbjax.runtime.step import model_step


def check_tensor_parallel(model: ModelConfig, tensor: int, num_devices: int) -> None:
    """One-line ValueErrors naming the fields when `tensor` can't split this model on these devices."""
    if tensor > num_devices:
        raise ValueError(f"executor.mesh.tensor={tensor} needs {tensor} devices, but only {num_devices} are visible")
    key = model.unsplit_by(tensor)
    if key is not None:
        raise ValueError(f"model.{key}={getattr(model, key)} is not divisible by executor.mesh.tensor={tensor}")


def make_mesh(tensor: int, devices=None) -> Mesh:
    """A ("tensor",) mesh of `tensor` devices: `devices` if given (one process), else the first
    tensor / process_count of each process."""
    if devices is not None:
        return Mesh(np.array(devices), (TENSOR,))
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


def replica_devices(tensors: list[int]) -> list[list[jax.Device]]:
    """Disjoint device sets, one per cluster replica: replica i takes `tensors[i]` devices
    after those of the replicas before it, in `jax.devices()` order."""
    devices = jax.devices()
    if sum(tensors) > len(devices):
        raise ValueError(
            f"cluster.replicas: {len(tensors)} replicas of executor.mesh.tensor {tensors} need {sum(tensors)} "
            f"devices, but only {len(devices)} are visible"
            + (" (on CPU, set XLA_FLAGS=--xla_force_host_platform_device_count=N before starting)"
               if jax.default_backend() == "cpu" else "")
        )  # fmt: skip
    out, lo = [], 0
    for n in tensors:
        out.append(devices[lo : lo + n])
        lo += n
    return out


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


class TensorParallel:
    """The executor's sharded side: placement of weights, cache and batches."""

    def __init__(self, model: ModelConfig, tensor: int, devices=None):
        """`devices`: the mesh's devices (as many as `tensor`); None: see `make_mesh`."""
        check_tensor_parallel(model, tensor, jax.device_count() if devices is None else len(devices))
        self.tensor = tensor
        self.mesh = make_mesh(tensor, devices)
        self.replicated = NamedSharding(self.mesh, P())
        self.cache_sharding = cache_sharding(self.mesh)

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

    def step(self, graphdef, attention: str) -> _MeshStep:
        """`model_step` (the one jit) bound to this mesh, graphdef and attention backend:
        called as step(weights, cache, batch), or `.lower(...)` with the same arguments."""
        return _MeshStep(graphdef, attention, self.mesh)


class _MeshStep:
    def __init__(self, graphdef, attention: str, mesh: Mesh):
        self.kwargs = dict(graphdef=graphdef, attention=attention, mesh=mesh, matmul="xla")

    def __call__(self, weights, cache, batch):
        return model_step(weights, cache, batch, **self.kwargs)

    def lower(self, weights, cache, batch):
        return model_step.lower(weights, cache, batch, **self.kwargs)
