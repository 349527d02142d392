"""Llama-family decoder (Llama, Mistral, Qwen2) as Flax NNX modules, and the dense oracle.

Parameters (module path: shape, logical axes). Every one is an `nnx.Param` whose
`out_sharding` metadata names logical axes from LOGICAL_AXES; `nnx.get_partition_spec`
under `nnx.logical_axis_rules` (naming every logical axis, None to replicate) turns them
into mesh PartitionSpecs. Heads keep their own axis, so mapping "heads", "kv_heads" and
"mlp" to one tensor-parallel mesh axis splits on head and hidden-unit boundaries with no
reshape.

    embed_tokens                      [vocab_size, d_model]             (vocab, embed)
    layers[i].input_layernorm.scale   [d_model]                         (embed,)
    layers[i].q_proj.kernel           [d_model, num_heads, head_dim]    (embed, heads, head_dim)
    layers[i].q_proj.bias             [num_heads, head_dim]             (heads, head_dim)       attention_bias
    layers[i].k_proj, v_proj          kernel [d_model, num_kv_heads, head_dim] (embed, kv_heads, head_dim),
                                      bias [num_kv_heads, head_dim]     (kv_heads, head_dim)    attention_bias
    layers[i].o_proj.kernel           [num_heads, head_dim, d_model]    (heads, head_dim, embed)
    layers[i].o_proj.bias             [d_model]                         (embed,)                o_proj_bias
    layers[i].post_attention_layernorm.scale [d_model]                  (embed,)
    layers[i].gate_proj, up_proj      kernel [d_model, ffn_dim]         (embed, mlp), bias [ffn_dim] (mlp,)
    layers[i].down_proj.kernel        [ffn_dim, d_model]                (mlp, embed), bias [d_model] (embed,)
    norm.scale                        [d_model]                         (embed,)
    lm_head                           [d_model, vocab_size]             (embed, vocab)          None if tied

`Llama.fused()` is the serving layout (see `DecoderLayer.fuse`): qkv_proj.kernel
[d_model, num_kv_heads, group + 2, head_dim] (embed, kv_heads, None, head_dim) with
group = num_heads // num_kv_heads, and gate_up_proj.kernel [d_model, 2, ffn_dim]
(embed, None, mlp). The KV cache [num_layers, num_kv_heads, num_pages, page_size,
head_dim] has axes `kv_cache_axes`.

Params and activations are in cfg.dtype; norms, RoPE and softmax run in f32.

The fused ops (`DecoderLayer.qkv_product`, `finish`, `Llama.logits`) run through a
`cbjax.model.ops.LayerOps` the caller passes: plain jnp (`XlaOps`) by default; the serving step
passes the one `executor.matmul` names. The model itself never knows which backend ran.

The jit boundary: never `nnx.jit` (it walks the object graph on every call). Split once,

    graphdef, state = nnx.split(model)            # graphdef is static and hashable
    step = jax.jit(lambda graphdef, state, *args: f(nnx.merge(graphdef, state), *args),
                   static_argnums=0)               # donate the KV cache argument here

and call `step(graphdef, state, ...)`: the weights are traced arguments, so a new state of
the same shapes reuses the compiled program.
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp
import ml_dtypes  # noqa: F401  registers bfloat16 with numpy, so weights are cast on the host
import numpy as np
from flax import nnx

from cbjax.config import ModelConfig
from cbjax.model.ops import RopeScaling, XlaOps, dense_apply, rope, rope_tables  # noqa: F401  rope, rope_tables: public here too

LOGICAL_AXES = ("vocab", "embed", "heads", "kv_heads", "head_dim", "mlp")
# KV cache [num_layers, num_kv_heads, num_pages, page_size, head_dim]
kv_cache_axes = (None, "kv_heads", None, None, "head_dim")

# Finite, so a fully masked row (a padding query) gives a uniform softmax, not NaN.
MASK_VALUE = -1e30

Axes = tuple[Optional[str], ...]
# The ops the model runs with when the caller passes none: plain jnp (`cbjax.model.ops`).
XLA_OPS = XlaOps()


def check_supported(cfg: ModelConfig) -> None:
    """Raise ValueError naming the field of an architecture this model can't express."""
    if cfg.mlp != "gated":
        raise ValueError(f"model.mlp: the JAX Llama model supports only 'gated' (SwiGLU), got {cfg.mlp!r}")
    if cfg.head_dim % 2:
        raise ValueError(f"model.head_dim must be even for RoPE, got {cfg.head_dim}")
    if cfg.dtype not in ("float32", "bfloat16"):
        raise ValueError(f"model.dtype: the JAX model needs float32 or bfloat16 (resolve 'auto'), got {cfg.dtype!r}")


def rope_scaling(cfg: ModelConfig) -> Optional[RopeScaling]:
    """The model's RoPE scaling (`model.rope_type` and its knobs); None for plain RoPE."""
    if cfg.rope_type == "default":
        return None
    return RopeScaling(cfg.rope_type, cfg.rope_factor, cfg.rope_low_freq_factor, cfg.rope_high_freq_factor,
                       cfg.rope_original_max_len)  # fmt: skip


def param(value: jax.Array, axes: Axes) -> nnx.Param:
    """A Param with logical partitioning metadata (flax 0.12's `out_sharding`).

    eager_sharding=False: flax would otherwise shard the value at creation, which needs a
    mesh; here the axes stay metadata until the state is placed on a mesh.
    """
    if len(axes) != value.ndim:
        raise ValueError(f"param: axes {axes} do not match shape {value.shape}")
    return nnx.Param(value, out_sharding=axes, eager_sharding=False)


class _Init:
    """Initial values: normal(0, 0.02) and ones drawn with numpy (seed), or zeros (seed None).

    numpy, not jax.random: jax.random compiles one program per tensor shape, which costs
    more than the draws for small models; jax.device_put, not jnp.asarray, which also
    compiles one (copy) program per shape. With seed None every value is a zeros
    placeholder, cheap under `nnx.eval_shape` (what a checkpoint loader fills).
    """

    def __init__(self, cfg: ModelConfig, seed: Optional[int]):
        self.dtype = jnp.dtype(cfg.dtype)
        self.rng = None if seed is None else np.random.default_rng(seed)

    def normal(self, shape: tuple[int, ...], drawn_as: Optional[tuple[int, ...]] = None) -> jax.Array:
        # `drawn_as`: the 2-D [in, out] shape the values are drawn in, so a seed gives the
        # same numbers as a Hugging Face-shaped [in, out] draw.
        if self.rng is None:
            return jnp.zeros(shape, self.dtype)
        values = 0.02 * self.rng.standard_normal(drawn_as or shape, dtype=np.float32)
        return jax.device_put(values.reshape(shape).astype(self.dtype))

    def ones(self, shape: tuple[int, ...]) -> jax.Array:
        return jnp.ones(shape, self.dtype) if self.rng is None else jax.device_put(np.ones(shape, self.dtype))


class RMSNorm(nnx.Module):
    def __init__(self, d_model: int, eps: float, init: _Init):
        self.scale = param(init.ones((d_model,)), ("embed",))
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        y = x.astype(jnp.float32) * self.factor(x)
        return self.scale[...] * y.astype(x.dtype)

    def factor(self, x: jax.Array) -> jax.Array:
        """f32[..., 1]: each row's rsqrt of its mean square plus eps (the norm is scale * (x * it))."""
        x32 = x.astype(jnp.float32)
        return jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)

    def parts(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        """(factor, scale): what a matmul that norms its input itself takes (float32 models)."""
        return self.factor(x), self.scale[...]


class Dense(nnx.Module):
    """x [..., *in] -> [..., *out]: one matmul contracting x's last `num_in` axes with the kernel's first."""

    def __init__(self, kernel: nnx.Param, bias: Optional[nnx.Param] = None, *, num_in: int = 1):
        self.kernel = kernel  # [*in, *out]
        self.bias = bias  # [*out] or None
        self.num_in = num_in

    def __call__(self, x: jax.Array) -> jax.Array:
        return dense_apply(self, x)


class DecoderLayer(nnx.Module):
    """Pre-norm attention + SwiGLU block, split at the attention op: `qkv`, then the caller's
    attention, then `finish`."""

    def __init__(self, cfg: ModelConfig, init: _Init):
        d, h, kv, hd, ffn = cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.ffn_dim
        self.num_heads, self.num_kv_heads, self.head_dim = h, kv, hd
        self.rope_theta = cfg.rope_theta
        self.rope_scaling = rope_scaling(cfg)

        def dense(shape, axes, bias, drawn_as=None, num_in=1):
            # weight then bias: the draw order of the Hugging Face-shaped init
            kernel = param(init.normal(shape, drawn_as), axes)
            out_shape, out_axes = shape[num_in:], axes[num_in:]
            return Dense(kernel, param(init.normal(out_shape), out_axes) if bias else None, num_in=num_in)

        self.input_layernorm = RMSNorm(d, cfg.norm_eps, init)
        qkv_bias = cfg.attention_bias
        # nnx.data: `fuse` swaps these for fused modules and None.
        self.q_proj = nnx.data(dense((d, h, hd), ("embed", "heads", "head_dim"), qkv_bias, (d, h * hd)))
        self.k_proj = nnx.data(dense((d, kv, hd), ("embed", "kv_heads", "head_dim"), qkv_bias, (d, kv * hd)))
        self.v_proj = nnx.data(dense((d, kv, hd), ("embed", "kv_heads", "head_dim"), qkv_bias, (d, kv * hd)))
        self.qkv_proj = nnx.data(None)
        self.o_proj = dense((h, hd, d), ("heads", "head_dim", "embed"), cfg.o_proj_bias, (h * hd, d), num_in=2)
        self.post_attention_layernorm = RMSNorm(d, cfg.norm_eps, init)
        self.gate_proj = nnx.data(dense((d, ffn), ("embed", "mlp"), cfg.mlp_bias))
        self.up_proj = nnx.data(dense((d, ffn), ("embed", "mlp"), cfg.mlp_bias))
        self.gate_up_proj = nnx.data(None)
        self.down_proj = dense((ffn, d), ("mlp", "embed"), cfg.mlp_bias)

    def qkv_product(self, x: jax.Array, positions: jax.Array, ops=XLA_OPS) -> jax.Array:
        """x [..., d_model], positions i32[...] -> the fused q/k/v product [..., num_kv_heads,
        group + 2, head_dim] of the normed x, RoPE applied to its q and k heads (`ops.qkv_rope`).
        The serving layout only (`fuse`)."""
        if self.qkv_proj is None:
            raise ValueError("DecoderLayer.qkv_product: the layer is not fused (call Llama.fused first)")
        return ops.qkv_rope(x, self.input_layernorm, self.qkv_proj, positions, self.rope_theta, self.rope_scaling)

    def qkv(self, x: jax.Array, positions: jax.Array, ops=XLA_OPS) -> tuple[jax.Array, jax.Array, jax.Array]:
        """x [..., d_model], positions i32[...] -> q [..., num_heads, head_dim], k and v
        [..., num_kv_heads, head_dim], RoPE applied to q and k."""
        if self.qkv_proj is not None:
            return self.split_qkv(self.qkv_product(x, positions, ops))
        h = self.input_layernorm(x)
        q, k, v = self.q_proj(h), self.k_proj(h), self.v_proj(h)
        theta, scaling = self.rope_theta, self.rope_scaling
        return rope(q, positions, theta, scaling), rope(k, positions, theta, scaling), v

    def split_qkv(self, product: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        """q [..., num_heads, head_dim], k and v [..., num_kv_heads, head_dim] of a fused q/k/v
        product [..., num_kv_heads, group + 2, head_dim]."""
        group = self.num_heads // self.num_kv_heads
        q = product[..., :group, :].reshape(*product.shape[:-3], self.num_heads, self.head_dim)
        return q, product[..., group, :], product[..., group + 1, :]

    def finish(self, x: jax.Array, attn: jax.Array, ops=XLA_OPS) -> jax.Array:
        """Residual o_proj of attn [..., num_heads, head_dim], then the residual SwiGLU block."""
        x = ops.matmul_residual(attn.astype(x.dtype), self.o_proj, x)
        if self.gate_up_proj is not None:
            h = ops.glu(x, self.post_attention_layernorm, self.gate_up_proj)
        else:  # the unfused layout (the oracle's)
            normed = self.post_attention_layernorm(x)
            h = jax.nn.silu(self.gate_proj(normed)) * self.up_proj(normed)
        return ops.matmul_residual(h, self.down_proj, x)

    def fuse(self) -> None:
        """In place: q/k/v become one matmul, and gate/up another (same numbers).

        qkv_proj groups by kv head: for kv head j, its `group` query heads (j*group ...
        j*group + group - 1, the GQA pairing), then its k head, then its v head. A plain
        [q | k | v] concatenation along one head axis could not be tensor-parallel sharded
        naively: an even split would hand one device only query heads and another only v
        heads. Grouped, the kv_heads axis shards exactly when the TP size divides
        num_kv_heads; beyond that the sharding issue must replicate kv heads per shard (or
        serve the unfused layout, whose "heads" axis shards on its own).
        """
        kv, group, hd = self.num_kv_heads, self.num_heads // self.num_kv_heads, self.head_dim
        q, k, v = self.q_proj, self.k_proj, self.v_proj
        d = q.kernel.shape[0]
        kernel = jnp.concatenate(
            [q.kernel[...].reshape(d, kv, group, hd), k.kernel[...][:, :, None], v.kernel[...][:, :, None]], axis=2
        )
        bias = None
        if q.bias is not None:
            parts = [q.bias[...].reshape(kv, group, hd), k.bias[...][:, None], v.bias[...][:, None]]
            bias = param(jnp.concatenate(parts, axis=1), ("kv_heads", None, "head_dim"))
        self.qkv_proj = Dense(param(kernel, ("embed", "kv_heads", None, "head_dim")), bias)
        self.q_proj = self.k_proj = self.v_proj = None

        gate, up = self.gate_proj, self.up_proj
        kernel = param(jnp.stack([gate.kernel[...], up.kernel[...]], axis=1), ("embed", None, "mlp"))
        bias = None if gate.bias is None else param(jnp.stack([gate.bias[...], up.bias[...]]), (None, "mlp"))
        self.gate_up_proj = Dense(kernel, bias)
        self.gate_proj = self.up_proj = None


class Llama(nnx.Module):
    """The decoder: `embed`, then each of `layers` (`qkv`, attention, `finish`), then `logits`.

    Llama(cfg, seed=s) draws random weights (normal(0, 0.02), norms ones) with numpy, the
    same numbers whatever the serving layout. Llama(cfg, seed=None) holds zeros: build it under `nnx.eval_shape` for an abstract model to fill.
    """

    def __init__(self, cfg: ModelConfig, *, seed: Optional[int] = 0):
        check_supported(cfg)
        init = _Init(cfg, seed)
        # Draw order (layers, embeddings, LM head) is the Hugging Face-shaped init's.
        self.layers = nnx.List([DecoderLayer(cfg, init) for _ in range(cfg.num_layers)])
        self.embed_tokens = param(init.normal((cfg.vocab_size, cfg.d_model)), ("vocab", "embed"))
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps, init)
        lm_head = None if cfg.tie_embeddings else init.normal((cfg.d_model, cfg.vocab_size))
        self.lm_head = None if lm_head is None else param(lm_head, ("embed", "vocab"))

    @property
    def is_fused(self) -> bool:
        return self.layers[0].qkv_proj is not None

    def embed(self, tokens: jax.Array) -> jax.Array:
        """tokens i32[...] -> x [..., d_model]."""
        return self.embed_tokens[...][tokens]

    def logits(self, x: jax.Array, ops=XLA_OPS) -> jax.Array:
        """Final norm and LM head (tied: the embedding table): x [..., d_model] -> f32[..., vocab_size]."""
        return ops.logits(x, self.norm, self.lm_head, self.embed_tokens)

    def fused(self) -> Llama:
        """A new model in the serving layout (`DecoderLayer.fuse`), same numbers; this one is unchanged.

        Decode's matmuls have few rows, so one wide matmul beats three narrow ones.
        """
        if self.is_fused:
            raise ValueError("Llama.fused: the model is already fused")
        model = nnx.clone(self)  # new Variables over the same (immutable) arrays
        for layer in model.layers:
            layer.fuse()
        return model


def dense_attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array) -> jax.Array:
    """q [b, t, num_heads, head_dim], k and v [b, s, num_kv_heads, head_dim], mask bool[b, t, s] -> like q."""
    b, t, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[2]
    qg = q.reshape(b, t, num_kv_heads, num_heads // num_kv_heads, head_dim)
    scores = jnp.einsum("btkgd,bskd->bkgts", qg, k, preferred_element_type=jnp.float32) / jnp.sqrt(head_dim)
    scores = jnp.where(mask[:, None, None], scores, MASK_VALUE)
    probs = jax.nn.softmax(scores, axis=-1)  # f32[b, num_kv_heads, group, t, s]
    out = jnp.einsum("bkgts,bskd->btkgd", probs.astype(v.dtype), v, preferred_element_type=jnp.float32)
    return out.reshape(b, t, num_heads, head_dim).astype(q.dtype)


def forward_dense(model: Llama, tokens: jax.Array) -> jax.Array:
    """tokens i32[T] -> logits f32[T, vocab_size]. Causal, no cache: the correctness oracle."""
    if tokens.ndim != 1:
        raise ValueError(f"forward_dense: tokens must be [T], got shape {tokens.shape}")
    num_tokens = tokens.shape[0]
    positions = jnp.arange(num_tokens)[None]  # i32[1, T]
    mask = jnp.tril(jnp.ones((num_tokens, num_tokens), bool))[None]  # bool[1, T, T]
    x = model.embed(tokens)[None]  # [1, T, d_model]
    for layer in model.layers:
        q, k, v = layer.qkv(x, positions)
        x = layer.finish(x, dense_attention(q, k, v, mask))
    return model.logits(x[0])
