"""The old engine's Llama as functions over a nested-dict param pytree (cbjax.model.paged uses it).

A compatibility layer until the executor runs the NNX model (`cbjax.model.llama`); the
weights come from that model (`params_from_model`), so both compute the same numbers.
Params mirror Hugging Face tensor names, with `model.` dropped:

    embed_tokens.weight                   [vocab_size, d_model]
    layers[i].input_layernorm.weight      [d_model]
    layers[i].self_attn.q_proj.weight     [d_model, num_heads * head_dim]   (+ .bias if attention_bias)
    layers[i].self_attn.k_proj.weight     [d_model, num_kv_heads * head_dim] (+ .bias if attention_bias)
    layers[i].self_attn.v_proj.weight     [d_model, num_kv_heads * head_dim] (+ .bias if attention_bias)
    layers[i].self_attn.o_proj.weight     [num_heads * head_dim, d_model]   (+ .bias if o_proj_bias)
    layers[i].post_attention_layernorm.weight [d_model]
    layers[i].mlp.gate_proj.weight        [d_model, ffn_dim]                (+ .bias if mlp_bias, as up/down)
    layers[i].mlp.up_proj.weight          [d_model, ffn_dim]
    layers[i].mlp.down_proj.weight        [ffn_dim, d_model]
    norm.weight                           [d_model]
    lm_head.weight                        [d_model, vocab_size]  (absent if tie_embeddings)

Linear weights are stored [in, out] so `x @ w` needs no transpose. Nothing here is jitted:
callers jit with cfg static.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp

from cbjax.config import ModelConfig
from cbjax.model.llama import Llama, rope

Params = dict[str, Any]


def init_params(cfg: ModelConfig, seed: int) -> Params:
    """Random weights ~ normal(0, 0.02), norms ones: the weights of `Llama(cfg, seed=seed)`."""
    return params_from_model(Llama(cfg, seed=seed))


def params_from_model(model: Llama) -> Params:
    """An unfused NNX model's weights in this layout (2-D [in, out] linear weights)."""
    if model.is_fused:
        raise ValueError("params_from_model: pass the unfused model")

    def linear(dense) -> Params:
        kernel = dense.kernel[...]
        p = {"weight": kernel.reshape(math.prod(kernel.shape[: dense.num_in]), -1)}  # [in, out]
        if dense.bias is not None:
            p["bias"] = dense.bias[...].reshape(-1)
        return p

    layers = [
        {
            "input_layernorm": {"weight": layer.input_layernorm.scale[...]},
            "self_attn": {name: linear(getattr(layer, name)) for name in ("q_proj", "k_proj", "v_proj", "o_proj")},
            "post_attention_layernorm": {"weight": layer.post_attention_layernorm.scale[...]},
            "mlp": {name: linear(getattr(layer, name)) for name in ("gate_proj", "up_proj", "down_proj")},
        }
        for layer in model.layers
    ]
    params: Params = {
        "embed_tokens": {"weight": model.embed_tokens[...]},
        "layers": layers,
        "norm": {"weight": model.norm.scale[...]},
    }
    if model.lm_head is not None:
        params["lm_head"] = {"weight": model.lm_head[...]}
    return params


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return weight * y.astype(x.dtype)


def linear(p: Params, x: jax.Array) -> jax.Array:
    y = x @ p["weight"]
    return y + p["bias"] if "bias" in p else y


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


def embed(params: Params, tokens: jax.Array) -> jax.Array:
    return params["embed_tokens"]["weight"][tokens]


def lm_logits(params: Params, x: jax.Array, cfg: ModelConfig) -> jax.Array:
    """Final norm and LM head: x [..., d_model] -> f32[..., vocab_size]."""
    h = rms_norm(x, params["norm"]["weight"], cfg.norm_eps)
    w = params["embed_tokens"]["weight"].T if cfg.tie_embeddings else params["lm_head"]["weight"]
    return jnp.dot(h, w, preferred_element_type=jnp.float32)
