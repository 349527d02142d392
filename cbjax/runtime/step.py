"""The one jitted model step per iteration: every scheduled token of the plan in one forward.

    greedy, logits, cache = model_step(weights, cache, batch, graphdef=graphdef, attention=name, matmul=mm)

The jit boundary is here, defined once: the model's weights and the batch are traced
arguments, the graph definitions and the attention backend's name are static, and the cache
is donated (updated in place). `split_model` splits an NNX `Llama` into the model without
its layers and the layers' weights stacked on a leading axis, so the step runs the layers
as one `lax.scan`: XLA compiles one layer body, not num_layers copies, which keeps warmup
short for deep models. K/V are written for every token before
attention; logits run only at each row's last token. The step returns each row's greedy
token (-1 where its logits are not finite) and the logits themselves, which stay on the
device: a batch with a sampled row passes them to `sample_step`, compiled once for all token
buckets since its shapes are [num_rows, vocab_size] (random keys and the top-k/top-p sort
cost seconds to compile on XLA:CPU, so they stay out of the per-bucket programs). Either way
one i32[num_rows] array comes back to the host.

Under tensor parallelism (`mesh`, static) the same body runs with sharded weights and cache
(`cbjax.runtime.mesh` jits it with explicit shardings); only the cache write and attention
change, running per shard on its own heads.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from flax import nnx

from cbjax.kernels.metadata import AttentionMetadata
from cbjax.kernels.registry import attention_op
from cbjax.model.llama import Dense
from cbjax.runtime.kv_cache import KVCache, write_layer
from cbjax.runtime.sampling import sample


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["tokens", "positions", "write_idx", "md", "logits_idx", "sampling", "feed", "prev_tokens"],
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


def check_batch(batch: DeviceBatch) -> None:
    """A ValueError naming the shapes when the batch's arrays disagree."""
    t = batch.tokens.shape
    r = batch.md.kv_lens.shape
    bad = batch.positions.shape != t or batch.write_idx.shape != t or batch.md.token_pos.shape != t
    bad |= batch.feed.shape != t or batch.prev_tokens.shape != r
    bad |= batch.logits_idx.shape != r or any(a.shape != r for a in batch.sampling)
    if len(t) != 1 or bad:
        raise ValueError(
            f"model_step: inconsistent batch shapes: tokens {t}, positions {batch.positions.shape}, "
            f"write_idx {batch.write_idx.shape}, token_pos {batch.md.token_pos.shape}, kv_lens {r}, "
            f"logits_idx {batch.logits_idx.shape}, sampling {[a.shape for a in batch.sampling]}, "
            f"feed {batch.feed.shape}, prev_tokens {batch.prev_tokens.shape}"
        )


def split_model(model, matmul: str = "xla") -> tuple[tuple, tuple]:
    """(graphdef, weights) of an NNX Llama for `model_step` with this resolved `matmul`:
    graphdef = (the model without its layers, one layer, matmul) is static and hashable;
    weights = (that model's state, every layer's state stacked on a leading num_layers axis).
    For matmul="native" the weight matrices (the layers' kernels, an untied LM head) are in
    panel order (`cbjax.kernels.native.to_panels`), as the native matmul reads them."""
    if matmul not in ("native", "xla"):
        raise ValueError(f"split_model: matmul must be a resolved 'native' or 'xla', got {matmul!r}")
    layers = list(model.layers)
    layer_def, _ = nnx.split(layers[0])
    stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *[nnx.state(layer) for layer in layers])
    shell = nnx.clone(model)
    shell.layers = nnx.List([])
    if matmul == "native":
        from cbjax.kernels.native import to_panels

        num_in = {path: dense.num_in for path, dense in nnx.iter_graph(layers[0]) if isinstance(dense, Dense)}
        for path, var in nnx.to_flat_state(stacked):
            if path[-1] == "kernel":
                var.set_value(jax.device_put(to_panels(var.get_value(), num_in[path[:-1]], lead=1)))
        if shell.lm_head is not None:
            shell.lm_head.set_value(jax.device_put(to_panels(shell.lm_head.get_value(), 1, lead=0)))
    outer_def, outer_state = nnx.split(shell)
    return (outer_def, layer_def, matmul), (outer_state, stacked)


# Backends that index the layer inside their own gathers (see cbjax.kernels.metadata).
LAYER_INDEXED = ("ragged", "native", "reference")


def step_fn(weights, cache: KVCache, batch: DeviceBatch, *, graphdef, attention: str, mesh=None, matmul: str = "xla"):
    """The step's body, unjitted: `model_step` jits it for one device, `cbjax.runtime.mesh`
    with explicit shardings for a tensor-parallel `mesh` (attention then runs per shard).

    matmul="native" (a resolved `executor.matmul`, one device, f32; the weights from
    `split_model(model, matmul="native")`, their matrices in panel order): the layers' weight
    matrices stay out of the scan's sliced inputs, and the native kernel multiplies the step's
    tokens (not its bucket's padding) by layer `i` of the stacked matrix in place, at every
    step size (XLA would copy each layer's weights out of the stack first); the fused gate/up
    matmul applies SwiGLU to its tiles as they leave the registers; the LM head runs on it too,
    a tied one reading the embedding table in place. The matmuls also take the RMS norm before
    them and the residual add after them, the layer's K/V go into the cache from the fused q/k/v
    product (`native.write_kv`, with native attention, which reads its queries there), and the
    embedding lookup and greedy tokens are native calls: no XLA op between a layer's calls but
    the norm's per-row factor. "xla": jnp.tensordot on the scan's slices.
    """
    check_batch(batch)
    outer_def, layer_def, split_for = graphdef
    outer_state, layer_states = weights
    model = nnx.merge(outer_def, outer_state)
    attn_fn = attention_op(attention)
    num_layers = cache.k.shape[0]
    if matmul not in ("native", "xla"):
        raise ValueError(f"model_step: matmul must be a resolved 'native' or 'xla', got {matmul!r}")
    if split_for != matmul:  # the weights' layout is the matmul's
        raise ValueError(f"model_step: matmul={matmul!r} needs weights from split_model(model, matmul={matmul!r}), "
                         f"got weights split for {split_for!r}")  # fmt: skip
    extra, head_mm, head_t = (), None, None
    if matmul == "native":
        from cbjax.kernels import native

        # the tokens of the step and the rows holding them (the native matmul skips the padding)
        num_tokens = batch.md.query_start[-1]
        num_rows_used = jnp.sum(batch.md.kv_lens > 0)

        head_mm = lambda x, w, num_in, **kw: native.layer_matmul(x, w[None], 0, num_in, live=num_rows_used, **kw)  # noqa: E731
        head_t = lambda h, w: native.matmul_nt(h, w, live=num_rows_used)  # noqa: E731
        # the kernels [num_layers, ...] are read whole by every layer; the rest is sliced
        stacked, layer_states = nnx.split_state(layer_states, nnx.PathContains("kernel"), ...)
        extra = (stacked,)

    def attend(q, k, v, k_pages, v_pages, md, write_idx, layer_idx):
        k_pages = write_layer(k_pages, layer_idx, write_idx, k)
        v_pages = write_layer(v_pages, layer_idx, write_idx, v)
        if attention in LAYER_INDEXED:  # gathers pages from the whole cache: no per-layer copy
            attn = attn_fn(q, k_pages, v_pages, md, layer=layer_idx)
        else:  # the Pallas kernel reads one layer's pages (a slice of the scan's carry)
            attn = attn_fn(q, k_pages[layer_idx], v_pages[layer_idx], md)
        return attn, k_pages, v_pages

    if mesh is not None:  # each shard attends with its own heads: no collective inside
        from cbjax.runtime.mesh import shard_heads

        attend = shard_heads(attend, mesh)

    def layer_step(carry, xs):
        x, k_pages, v_pages = carry
        layer_state, layer_idx = xs
        layer = nnx.merge(layer_def, layer_state, *extra)
        mm = glu = rope_mm = None
        if extra:
            # each takes the norm before it or the residual after it (`cbjax.model.llama.Matmul`)
            mm = lambda x, w, num_in, **kw: native.layer_matmul(x, w, layer_idx, num_in, live=num_tokens, **kw)  # noqa: E731
            gate_up = layer.gate_up_proj  # its kernel stacked: [num_layers, d_model, 2, ffn_dim]
            if gate_up is not None and native.glu_applies(gate_up.kernel.shape):  # SwiGLU in the epilogue
                glu = lambda h, w, **kw: native.layer_matmul_glu(h, w, layer_idx, live=num_tokens, **kw)  # noqa: E731
            qkv_proj = layer.qkv_proj  # [num_layers, d_model, num_kv_heads, group + 2, head_dim]
            if qkv_proj is not None and native.rope_applies(qkv_proj.kernel.shape, layer.head_dim):  # RoPE in the epilogue
                rope_mm = lambda h, w, c, s, **kw: native.layer_matmul_rope(h, w, layer_idx, c, s, live=num_tokens, **kw)  # noqa: E731
        # The native attention reads the fused q/k/v product in place, and the layer's K/V go into
        # the cache from it in one call: no copies of the q, k and v slices, no XLA scatters.
        in_place = attention == "native" and mesh is None and k_pages.dtype == jnp.float32
        product = layer.rope_qkv(x, batch.positions, rope_mm) if in_place else None
        if product is not None:
            q, _, _ = layer.split_qkv(product)  # for its shape: the kernels read the product
            k_pages, v_pages = native.write_kv(product, batch.write_idx, layer_idx, k_pages, v_pages)
            attn = attn_fn(q, k_pages, v_pages, batch.md, layer=layer_idx, qkv=product)
        else:
            q, k, v = layer.qkv(x, batch.positions, mm, rope_mm)  # q [T, num_heads, head_dim], k, v [T, num_kv_heads, head_dim]
            attn, k_pages, v_pages = attend(q, k, v, k_pages, v_pages, batch.md, batch.write_idx, layer_idx)
        x = layer.finish(x, attn, mm, glu)
        return (x, k_pages, v_pages), None

    if matmul == "native":  # model.embed's lookup, with the fed tokens picked in the same pass
        x = native.embed(model.embed_tokens[...], batch.tokens, batch.feed, batch.prev_tokens)  # [T, d_model]
    else:
        tokens = jnp.where(batch.feed >= 0, batch.prev_tokens[jnp.maximum(batch.feed, 0)], batch.tokens)
        x = model.embed(tokens)  # [T, d_model]
    carry = (x, cache.k, cache.v)
    (x, k_pages, v_pages), _ = jax.lax.scan(layer_step, carry, (layer_states, jnp.arange(num_layers)))
    # A step of T tokens holds at most T rows, and rows are filled first to last: in a bucket
    # smaller than the slot array only the first T rows can have logits. The LM head runs on
    # those (for a 135M model on 32 slots it is a third of a small decode step's FLOPs); the
    # outputs keep their [R] and [R, vocab] shapes, zeros past T (idle rows, never read). The
    # native head takes all R rows and writes zeros past the used ones itself: padding its
    # output with XLA's pad (an element loop over [R, vocab]) took 0.1 ms a small step.
    num_rows = batch.logits_idx.shape[0]
    live = min(num_rows, batch.tokens.shape[0])
    if matmul == "native":
        logits = model.logits(x[batch.logits_idx], head_mm, head_t)  # f32[num_rows, vocab_size]
        # One vectorized pass a row, zeros past the used rows (as the padding below gives): XLA's
        # three scalar reductions (maximum, first index, finite) took a tenth of a small step.
        greedy = native.greedy(logits, jnp.minimum(num_rows_used, live))
    else:
        logits = model.logits(x[batch.logits_idx[:live]])  # f32[live, vocab_size]
        greedy = _mark_non_finite(logits, first_argmax(logits))
        if live < num_rows:
            logits = jnp.pad(logits, ((0, num_rows - live), (0, 0)))
            greedy = jnp.pad(greedy, (0, num_rows - live))
    return greedy, logits, KVCache(k=k_pages, v=v_pages)


# XLA options for the step on XLA:CPU. Its tree reduction rewriter splits any reduction longer
# than 32 into a reduce-window and a reduce, so the attention's scores over head_dim 64 (q * k
# summed over d) are materialized in full instead of summed as they are multiplied: in a
# SmolLM-shaped 16-row decode step (150-170 ms) the product, reduce-window and reduce took
# 20-25 ms, the fused multiply-reduce without the split 6 ms. The step's
# reductions are short (head_dim, d_model, a page step of keys), so the pass buys no accuracy
# that matters here; other programs keep it.
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


def first_argmax(logits: jax.Array) -> jax.Array:
    """i32[...]: the first index of each row's maximum, as `jnp.argmax` (for finite rows) but as
    two plain reductions: XLA:CPU runs argmax's (value, index) reduction 1.5-2.4x slower
    (measured on [32, 4096] to [32, 49152] logits)."""
    top = jnp.max(logits, axis=-1, keepdims=True)
    iota = jax.lax.broadcasted_iota(jnp.int32, logits.shape, logits.ndim - 1)
    return jnp.min(jnp.where(logits == top, iota, logits.shape[-1]), axis=-1).astype(jnp.int32)


def _mark_non_finite(logits: jax.Array, tokens: jax.Array) -> jax.Array:
    return jnp.where(jnp.all(jnp.isfinite(logits), axis=-1), tokens, -1)


@jax.jit
def sample_step(logits: jax.Array, sampling: tuple) -> jax.Array:  # i32[R]
    """Per-row temperature / top-k / top-p sampling of the step's logits; -1 where not finite."""
    return _mark_non_finite(logits, sample(logits, *sampling))
