"""The one jitted model step per iteration: every scheduled token of the plan in one forward.

    greedy, logits, cache = model_step(weights, cache, batch, graphdef=graphdef, attention=name, matmul=ops)

The jit boundary is here, defined once, for one device and tensor parallelism alike: the
model's weights and the batch are traced arguments; the graph definitions, the attention
backend's name, the `LayerOps` name (`executor.matmul`) and the mesh are static; the cache is
donated (updated in place). Under a mesh the shardings come from how the weights and cache were
placed (`cbjax.runtime.mesh`); only the cache write and attention change, running per shard on
its own heads (`cbjax.runtime.shard.shard_heads`), and the outputs are pinned replicated.

`split_model` splits an NNX `Llama` into the model without its layers and the layers' weights
stacked on a leading axis, so the step runs the layers as one `lax.scan`: XLA compiles one
layer body, not num_layers copies, which keeps warmup short for deep models. K/V are written
for every token before attention; logits run only at each row's last token. The step returns
each row's greedy token (-1 where its logits are not finite) and the logits themselves, which
stay on the device: a batch with a sampled row passes them to `sample_step`, compiled once for
all token buckets since its shapes are [num_rows, vocab_size] (random keys and the top-k/top-p
sort are slow to compile on XLA:CPU, so they stay out of the per-bucket programs). Either way
one i32[num_rows] array comes back to the host.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from cbjax.kernels.metadata import AttentionMetadata
from cbjax.kernels.registry import attention_op, layer_ops
from cbjax.kernels.xla_ragged import RaggedWork, Tiles
from cbjax.model.llama import Dense
from cbjax.runtime.batch import HostBatch
from cbjax.model.ops import first_argmax, mark_non_finite  # noqa: F401  first_argmax: public here too
from cbjax.runtime.kv_cache import KVCache
from cbjax.runtime.sampling import sample
from cbjax.runtime.shard import constrain_cache, replicate, shard_heads
from cbjax.runtime.verify import greedy_verify, place_drafts, verify_rows


@functools.partial(jax.tree_util.register_dataclass, data_fields=["num_drafts", "drafts"], meta_fields=[])
@dataclasses.dataclass(frozen=True)
class SpecInputs:
    """The drafts a step verifies (`cbjax.runtime.verify`): row r's last num_drafts[r] tokens."""

    num_drafts: jax.Array  # i32[R]
    drafts: jax.Array  # i32[R, k]; past num_drafts[r]: anything


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["tokens", "positions", "write_idx", "md", "logits_idx", "sampling", "feed", "prev_tokens", "spec"],
    meta_fields=[],
)
@dataclasses.dataclass(frozen=True)
class DeviceBatch:
    tokens: jax.Array  # i32[T]
    positions: jax.Array  # i32[T]
    write_idx: jax.Array  # i32[T]
    md: AttentionMetadata
    logits_idx: jax.Array  # i32[R]
    sampling: tuple  # temperature f32[R], top_k i32[R], top_p f32[R], seed u32[R], position i32[R]
    # Pipelined serving: token slot t takes prev_tokens[feed[t]] where feed[t] >= 0 (a decode
    # whose token the previous step sampled and the host has not read yet), else tokens[t].
    feed: jax.Array  # i32[T]
    prev_tokens: jax.Array  # i32[R]: the previous step's output (its greedy or sampled tokens)
    # Speculative decoding: the drafts the step verifies; None: no speculation (one token per row).
    spec: Optional[SpecInputs] = None


def to_device(batch: HostBatch, prev_tokens=None) -> DeviceBatch:
    """The step's argument for `batch`; `prev_tokens` (i32[R], default zeros) is the previous
    step's output, which the batch's `feed` slots read."""
    if prev_tokens is None:
        prev_tokens = np.zeros(batch.logits_idx.shape, np.int32)
    work = None
    if batch.tiles is not None:
        single, block = batch.tiles
        work = RaggedWork(single=Tiles(*single), block=Tiles(*block))
    md = AttentionMetadata(
        page_table=batch.page_table, query_start=batch.query_start, kv_lens=batch.kv_lens,
        token_row=batch.token_row, token_pos=batch.token_pos, work=work,
    )  # fmt: skip
    spec = None if batch.spec is None else SpecInputs(batch.spec.num_drafts, batch.spec.drafts)
    return DeviceBatch(
        tokens=batch.tokens, positions=batch.positions, write_idx=batch.write_idx, md=md,
        logits_idx=batch.logits_idx, sampling=batch.sampling, feed=batch.feed, prev_tokens=prev_tokens, spec=spec,
    )  # fmt: skip


def check_batch(batch: DeviceBatch) -> None:
    """A ValueError naming the shapes when the batch's arrays disagree."""
    t = batch.tokens.shape
    r = batch.md.kv_lens.shape
    bad = batch.positions.shape != t or batch.write_idx.shape != t or batch.md.token_pos.shape != t
    bad |= batch.feed.shape != t or batch.prev_tokens.shape != r
    bad |= batch.logits_idx.shape != r or any(a.shape != r for a in batch.sampling)
    if batch.spec is not None:
        bad |= batch.spec.num_drafts.shape != r or batch.spec.drafts.ndim != 2 or batch.spec.drafts.shape[0] != r[0]
    if len(t) != 1 or bad:
        raise ValueError(
            f"model_step: inconsistent batch shapes: tokens {t}, positions {batch.positions.shape}, "
            f"write_idx {batch.write_idx.shape}, token_pos {batch.md.token_pos.shape}, kv_lens {r}, "
            f"logits_idx {batch.logits_idx.shape}, sampling {[a.shape for a in batch.sampling]}, "
            f"feed {batch.feed.shape}, prev_tokens {batch.prev_tokens.shape}"
        )


def split_model(model, matmul: str = "xla") -> tuple[tuple, tuple]:
    """(graphdef, weights) of an NNX Llama for `model_step` with this resolved `matmul` (a
    registered `LayerOps` name): graphdef = (the model without its layers, one layer, matmul)
    is static and hashable; weights = (that model's state, every layer's state stacked on a
    leading num_layers axis), the weight matrices (the layers' kernels, an untied LM head) in
    the layout the ops read (`LayerOps.weight_layout`)."""
    if matmul == "auto":
        raise ValueError(f"split_model: matmul must be a resolved name (see resolve_matmul), got {matmul!r}")
    ops = layer_ops(matmul)
    layers = list(model.layers)
    layer_def, _ = nnx.split(layers[0])
    stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *[nnx.state(layer) for layer in layers])
    shell = nnx.clone(model)
    shell.layers = nnx.List([])
    num_in = {path: dense.num_in for path, dense in nnx.iter_graph(layers[0]) if isinstance(dense, Dense)}
    for path, var in nnx.to_flat_state(stacked):
        if path[-1] == "kernel":
            laid = ops.weight_layout(var.get_value(), num_in[path[:-1]], 1)
            if laid is not var.get_value():
                var.set_value(jax.device_put(laid))
    if shell.lm_head is not None:
        laid = ops.weight_layout(shell.lm_head.get_value(), 1, 0)
        if laid is not shell.lm_head.get_value():
            shell.lm_head.set_value(jax.device_put(laid))
    outer_def, outer_state = nnx.split(shell)
    return (outer_def, layer_def, matmul), (outer_state, stacked)


def forward(weights, cache: KVCache, batch: DeviceBatch, *, graphdef, attention: str, mesh=None, matmul: str = "xla",
            num_layers: Optional[int] = None):  # fmt: skip
    """The decoder over the batch's flat tokens, K/V written for each: (the model without its
    layers, the ops bound to the batch, the last layer's output x [T, d_model], the new cache).
    `num_layers`: only the first N layers run (a self-speculative draft); the cache's other
    layers are left as they are. The rest as `step_fn`."""
    outer_def, layer_def, split_for = graphdef
    outer_state, layer_states = weights
    if split_for != matmul:  # the weights' layout is the ops'
        raise ValueError(f"model_step: matmul={matmul!r} needs weights from split_model(model, matmul={matmul!r}), "
                         f"got weights split for {split_for!r}")  # fmt: skip
    model = nnx.merge(outer_def, outer_state)
    attn_fn = attention_op(attention)
    ops = layer_ops(matmul).bind(batch)
    total = cache.k.shape[0]
    whole, layer_states = ops.split_stacked(layer_states)

    def attend(product, k_pages, v_pages, md, write_idx, layer_idx):
        # product [T, num_kv_heads, group + 2, head_dim]; every backend reads the layer's pages
        # from the whole cache (no per-layer copy)
        k_pages, v_pages = ops.write_kv(product, write_idx, layer_idx, k_pages, v_pages)
        num_tokens, num_kv_heads, width, head_dim = product.shape
        q = product[:, :, : width - 2].reshape(num_tokens, num_kv_heads * (width - 2), head_dim)
        return attn_fn(q, k_pages, v_pages, md, layer=layer_idx, qkv=product), k_pages, v_pages

    if mesh is not None:  # each shard attends with its own heads: no collective inside
        attend = shard_heads(attend, mesh)

    def layer_step(carry, xs):
        x, k_pages, v_pages = carry
        layer_state, layer_idx = xs
        layer = nnx.merge(layer_def, layer_state, *whole)
        lops = ops.at_layer(layer_idx)  # the ops for this layer of the scan
        product = layer.qkv_product(x, batch.positions, lops)
        attn, k_pages, v_pages = attend(product, k_pages, v_pages, batch.md, batch.write_idx, layer_idx)
        x = layer.finish(x, attn, lops)
        return (x, k_pages, v_pages), None

    def first_layers(carry, layer_idx):  # a layer's weights indexed in place: no copy of the first N
        layer_state = jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, layer_idx, keepdims=False), layer_states)
        return layer_step(carry, (layer_state, layer_idx))

    x = ops.embed(model.embed_tokens[...], batch.tokens, batch.feed, batch.prev_tokens)  # [T, d_model]
    carry = (x, cache.k, cache.v)
    if num_layers is None or num_layers == total:
        (x, k_pages, v_pages), _ = jax.lax.scan(layer_step, carry, (layer_states, jnp.arange(total)))
    else:
        (x, k_pages, v_pages), _ = jax.lax.scan(first_layers, carry, jnp.arange(num_layers))
    return model, ops, x, KVCache(k=k_pages, v=v_pages)


def step_fn(weights, cache: KVCache, batch: DeviceBatch, *, graphdef, attention: str, mesh=None, matmul: str = "xla"):
    """The step's body, unjitted (`model_step` jits it). `attention`: a resolved attention
    backend; `matmul`: a resolved `LayerOps` name, the one the weights were split for; `mesh`:
    a tensor-parallel mesh the weights and cache are placed on, or None (one device).

    With drafts (`batch.spec`): they enter their token slots, the LM head runs at each row's
    last num_drafts + 1 tokens, and the step returns the greedy verification packed
    i32[R, k + 2] and the logits f32[R, k + 1, vocab_size] (`cbjax.runtime.verify`)."""
    check_batch(batch)
    spec = batch.spec
    if spec is not None:
        tokens = place_drafts(batch.tokens, batch.logits_idx, spec.num_drafts, spec.drafts)
        batch = dataclasses.replace(batch, tokens=tokens)
    model, ops, x, new_cache = forward(
        weights, cache, batch, graphdef=graphdef, attention=attention, mesh=mesh, matmul=matmul
    )
    if spec is None:
        greedy, logits = ops.head(x, batch.logits_idx, model.norm, model.lm_head, model.embed_tokens)
    else:
        k = spec.drafts.shape[1]
        entry_idx, gather, live = verify_rows(batch.logits_idx, spec.num_drafts, batch.md.kv_lens, k, x.shape[0])
        target, logits = ops.head(x, entry_idx, model.norm, model.lm_head, model.embed_tokens, live=live)
        greedy, logits = greedy_verify(target[gather], spec.drafts, spec.num_drafts), logits[gather]
    if mesh is not None:  # the tokens and logits replicated for the host, the cache as it was placed
        greedy, logits = replicate(greedy, mesh), replicate(logits, mesh)
        new_cache = KVCache(k=constrain_cache(new_cache.k, mesh), v=constrain_cache(new_cache.v, mesh))
    return greedy, logits, new_cache


# XLA options for the step on XLA:CPU. Its tree reduction rewriter splits any reduction longer
# than 32 into a reduce-window and a reduce, so the attention's scores over head_dim 64 (q * k
# summed over d) are materialized in full instead of summed as they are multiplied
# (docs/cpu_kernels.md has the measurement). The step's reductions are short (head_dim, d_model,
# a page step of keys), so the pass buys no accuracy that matters here; other programs keep it.
CPU_STEP_OPTIONS = {"xla_disable_hlo_passes": "tree_reduction_rewriter"}


def step_compiler_options(backend: str | None = None) -> dict | None:
    """The XLA compiler options of the step on `backend` (default: jax's)."""
    return dict(CPU_STEP_OPTIONS) if (backend or jax.default_backend()) == "cpu" else None


@functools.cache
def _jitted_step(backend: str):
    return jax.jit(
        step_fn, static_argnames=("graphdef", "attention", "mesh", "matmul"), donate_argnames=("cache",),
        compiler_options=step_compiler_options(backend),
    )  # fmt: skip


class _ModelStep:
    """`step_fn` jitted with the options of the default backend, chosen at the first call (not
    at import: importing cbjax must not start a jax backend)."""

    def __call__(self, *args, **kwargs):
        return _jitted_step(jax.default_backend())(*args, **kwargs)

    def lower(self, *args, **kwargs):
        return _jitted_step(jax.default_backend()).lower(*args, **kwargs)


model_step = _ModelStep()


@jax.jit
def sample_step(logits: jax.Array, sampling: tuple) -> jax.Array:  # i32[R]
    """Per-row temperature / top-k / top-p sampling of the step's logits; -1 where not finite."""
    return mark_non_finite(logits, sample(logits, *sampling))
