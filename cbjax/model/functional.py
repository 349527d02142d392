"""Llama-family decoder (Llama, Qwen2) as pure functions over a nested-dict param pytree.

Params mirror Hugging Face tensor names, with `model.` dropped:

    embed_tokens.weight                   [vocab_size, d_model]
    layers[i].input_layernorm.weight      [d_model]
    layers[i].self_attn.q_proj.weight     [d_model, num_heads * head_dim]   (+ .bias if attention_bias)
    layers[i].self_attn.k_proj.weight     [d_model, num_kv_heads * head_dim] (+ .bias if attention_bias)
    layers[i].self_attn.v_proj.weight     [d_model, num_kv_heads * head_dim] (+ .bias if attention_bias)
    layers[i].self_attn.o_proj.weight     [num_heads * head_dim, d_model]
    layers[i].post_attention_layernorm.weight [d_model]
    layers[i].mlp.gate_proj.weight        [d_model, ffn_dim]
    layers[i].mlp.up_proj.weight          [d_model, ffn_dim]
    layers[i].mlp.down_proj.weight        [ffn_dim, d_model]
    norm.weight                           [d_model]
    lm_head.weight                        [d_model, vocab_size]  (absent if tie_embeddings)

Linear weights are stored [in, out] so `x @ w` needs no transpose; Hugging Face stores
nn.Linear weights [out, in], so a loader transposes every `*_proj` and `lm_head` weight
(not embed_tokens). Params and activations are in cfg.dtype; norms, RoPE and softmax run
in f32. Nothing here is jitted: callers jit with cfg static.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from cbjax.config import ModelConfig

Params = dict[str, Any]

# Finite, so a fully masked row (a padding query) gives a uniform softmax, not NaN.
MASK_VALUE = -1e30


def check_supported(cfg: ModelConfig) -> None:
    if cfg.mlp != "gated":
        raise ValueError(f"model.mlp: the JAX Llama model supports only 'gated' (SwiGLU), got {cfg.mlp!r}")
    if cfg.head_dim % 2:
        raise ValueError(f"model.head_dim must be even for RoPE, got {cfg.head_dim}")


def init_params(cfg: ModelConfig, seed: int) -> Params:
    """Random weights and biases ~ normal(0, 0.02); norm weights are ones.

    Drawn with numpy on the host: jax.random would compile one program per tensor shape,
    which costs more than the draws for small models.
    """
    check_supported(cfg)
    dtype = jnp.dtype(cfg.dtype)
    rng = np.random.default_rng(seed)
    d, q_dim, kv_dim = cfg.d_model, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim

    def normal(shape):
        return jnp.asarray(0.02 * rng.standard_normal(shape, dtype=np.float32), dtype)

    def linear(d_in, d_out, bias=False):
        p = {"weight": normal((d_in, d_out))}
        if bias:
            p["bias"] = normal((d_out,))
        return p

    def norm():
        return {"weight": jnp.asarray(np.ones((d,), np.float32), dtype)}

    layers = [
        {
            "input_layernorm": norm(),
            "self_attn": {
                "q_proj": linear(d, q_dim, cfg.attention_bias),
                "k_proj": linear(d, kv_dim, cfg.attention_bias),
                "v_proj": linear(d, kv_dim, cfg.attention_bias),
                "o_proj": linear(q_dim, d),
            },
            "post_attention_layernorm": norm(),
            "mlp": {
                "gate_proj": linear(d, cfg.ffn_dim),
                "up_proj": linear(d, cfg.ffn_dim),
                "down_proj": linear(cfg.ffn_dim, d),
            },
        }
        for _ in range(cfg.num_layers)
    ]
    params: Params = {"embed_tokens": {"weight": normal((cfg.vocab_size, d))}, "layers": layers, "norm": norm()}
    if not cfg.tie_embeddings:
        params["lm_head"] = linear(d, cfg.vocab_size)
    return params


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return weight * y.astype(x.dtype)


def linear(p: Params, x: jax.Array) -> jax.Array:
    y = x @ p["weight"]
    return y + p["bias"] if "bias" in p else y


def rope(x: jax.Array, positions: jax.Array, theta: float) -> jax.Array:
    """Rotary embedding, Hugging Face rotate_half convention: x [..., n, head_dim], positions i32[...]."""
    head_dim = x.shape[-1]
    half = head_dim // 2
    inv_freq = 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))  # f32[half]
    freqs = positions[..., None].astype(jnp.float32) * inv_freq  # f32[..., half]
    angles = jnp.concatenate([freqs, freqs], axis=-1)[..., None, :]  # f32[..., 1, head_dim]
    x32 = x.astype(jnp.float32)
    rotated = jnp.concatenate([-x32[..., half:], x32[..., :half]], axis=-1)
    return (x32 * jnp.cos(angles) + rotated * jnp.sin(angles)).astype(x.dtype)


def attention_qkv(layer: Params, x: jax.Array, positions: jax.Array, cfg: ModelConfig):
    """x [..., d_model], positions i32[...] -> q [..., num_heads, head_dim], k, v [..., num_kv_heads, head_dim]."""
    lead = x.shape[:-1]
    attn = layer["self_attn"]
    h = rms_norm(x, layer["input_layernorm"]["weight"], cfg.norm_eps)
    if "qkv_proj" in attn:  # fused by `fuse_projections`: one matmul, then split
        q_dim, kv_dim = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        qkv = linear(attn["qkv_proj"], h)
        q, k, v = qkv[..., :q_dim], qkv[..., q_dim : q_dim + kv_dim], qkv[..., q_dim + kv_dim :]
    else:
        q, k, v = linear(attn["q_proj"], h), linear(attn["k_proj"], h), linear(attn["v_proj"], h)
    q = q.reshape(*lead, cfg.num_heads, cfg.head_dim)
    k = k.reshape(*lead, cfg.num_kv_heads, cfg.head_dim)
    v = v.reshape(*lead, cfg.num_kv_heads, cfg.head_dim)
    return rope(q, positions, cfg.rope_theta), rope(k, positions, cfg.rope_theta), v


def attention_out_and_mlp(layer: Params, x: jax.Array, attn: jax.Array, cfg: ModelConfig) -> jax.Array:
    """Residual o_proj of attn [..., num_heads, head_dim], then the residual SwiGLU block."""
    x = x + linear(layer["self_attn"]["o_proj"], attn.reshape(*attn.shape[:-2], -1).astype(x.dtype))
    h = rms_norm(x, layer["post_attention_layernorm"]["weight"], cfg.norm_eps)
    mlp = layer["mlp"]
    if "gate_up_proj" in mlp:  # fused by `fuse_projections`
        gate_up = linear(mlp["gate_up_proj"], h)
        ffn = gate_up.shape[-1] // 2
        gate, up = gate_up[..., :ffn], gate_up[..., ffn:]
    else:
        gate, up = linear(mlp["gate_proj"], h), linear(mlp["up_proj"], h)
    return x + linear(mlp["down_proj"], jax.nn.silu(gate) * up)


def fuse_projections(params: Params) -> Params:
    """The same model with q/k/v and gate/up each concatenated into one weight (and bias).

    Serving layout: decode's matmuls have few rows, so one wide matmul beats three narrow
    ones. The loaded (Hugging Face shaped) params stay the public layout; the model
    functions accept either.
    """

    def cat(parts: list[Params]) -> Params:
        fused = {"weight": jnp.concatenate([p["weight"] for p in parts], axis=1)}
        if all("bias" in p for p in parts):
            fused["bias"] = jnp.concatenate([p["bias"] for p in parts])
        elif any("bias" in p for p in parts):  # Qwen2-style q/k/v biases come all or none
            raise ValueError("fuse_projections: some of the fused projections have a bias and some do not")
        return fused

    layers = []
    for layer in params["layers"]:
        attn, mlp = layer["self_attn"], layer["mlp"]
        layers.append({
            **layer,
            "self_attn": {"qkv_proj": cat([attn["q_proj"], attn["k_proj"], attn["v_proj"]]), "o_proj": attn["o_proj"]},
            "mlp": {"gate_up_proj": cat([mlp["gate_proj"], mlp["up_proj"]]), "down_proj": mlp["down_proj"]},
        })  # fmt: skip
    return {**params, "layers": layers}


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


def embed(params: Params, tokens: jax.Array) -> jax.Array:
    return params["embed_tokens"]["weight"][tokens]


def lm_logits(params: Params, x: jax.Array, cfg: ModelConfig) -> jax.Array:
    """Final norm and LM head: x [..., d_model] -> f32[..., vocab_size]."""
    h = rms_norm(x, params["norm"]["weight"], cfg.norm_eps)
    w = params["embed_tokens"]["weight"].T if cfg.tie_embeddings else params["lm_head"]["weight"]
    return jnp.dot(h, w, preferred_element_type=jnp.float32)


def forward_dense(params: Params, tokens: jax.Array, cfg: ModelConfig) -> jax.Array:
    """tokens i32[T] -> logits f32[T, vocab_size]. Causal, no cache: the correctness oracle."""
    if tokens.ndim != 1:
        raise ValueError(f"forward_dense: tokens must be [T], got shape {tokens.shape}")
    check_supported(cfg)
    num_tokens = tokens.shape[0]
    positions = jnp.arange(num_tokens)[None]  # i32[1, T]
    mask = jnp.tril(jnp.ones((num_tokens, num_tokens), bool))[None]  # bool[1, T, T]
    x = embed(params, tokens)[None]  # [1, T, d_model]
    for layer in params["layers"]:
        q, k, v = attention_qkv(layer, x, positions, cfg)
        x = attention_out_and_mlp(layer, x, dense_attention(q, k, v, mask), cfg)
    return lm_logits(params, x[0], cfg)
