"""Tiny Llama configs, a weight-scaled NNX model, the jitted dense forward, and a float64 numpy oracle."""

from __future__ import annotations

import dataclasses
import functools

import jax
import numpy as np
from flax import nnx

from cbjax.config import ModelConfig
from cbjax.model.llama import Llama, forward_dense

TINY = ModelConfig()  # vocab 512, d_model 64, 2 layers, 4 heads, 2 kv heads, head_dim 16, ffn 128
QWEN_LIKE = dataclasses.replace(TINY, attention_bias=True, tie_embeddings=True, rope_theta=1e6)
# Llama with attention_bias: q/k/v and o_proj biases, and MLP biases; GQA 4:1
BIASED = dataclasses.replace(TINY, num_kv_heads=1, attention_bias=True, o_proj_bias=True, mlp_bias=True)

_MATRICES = ("kernel", "embed_tokens", "lm_head")


def scaled_llama(cfg: ModelConfig, seed: int = 0) -> Llama:
    """Llama(cfg, seed) with every matrix scaled by 4.

    At std 0.02 attention is nearly uniform and an off-by-one RoPE position moves logits by
    only ~3e-3; scaled by 4 it moves them by ~0.2.
    """
    model = Llama(cfg, seed=seed)
    for path, node in nnx.iter_graph(model):
        if isinstance(node, nnx.Param) and path[-1] in _MATRICES:
            node.set_value(jax.device_put(np.asarray(node[...]) * 4))
    return model


@functools.partial(jax.jit, static_argnums=0)
def dense_logits(graphdef, state, tokens):
    """forward_dense behind the documented jit boundary: graphdef static, state traced."""
    return forward_dense(nnx.merge(graphdef, state), tokens)


def dense(model: Llama, tokens) -> np.ndarray:
    return np.asarray(dense_logits(*nnx.split(model), np.asarray(tokens, np.int32)))


def numpy_forward(model: Llama, cfg: ModelConfig, tokens) -> np.ndarray:
    """The causal forward in float64 numpy, written from the Llama equations, not the module code."""

    def w(variable):
        return None if variable is None else np.asarray(variable[...], np.float64)

    def rms(x, scale):
        return scale * x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + cfg.norm_eps)

    def proj(dense, x, spec):
        y = np.einsum(spec, x, w(dense.kernel))
        return y if dense.bias is None else y + w(dense.bias)

    tokens = np.asarray(tokens)
    num_tokens, hd = len(tokens), cfg.head_dim
    inv_freq = cfg.rope_theta ** (-np.arange(0, hd, 2) / hd)
    angles = np.arange(num_tokens)[:, None] * inv_freq  # [T, head_dim / 2]
    cos, sin = np.cos(angles)[:, None], np.sin(angles)[:, None]

    def rope(x):  # x [T, n, head_dim]; rotate_half: pairs (i, i + head_dim / 2)
        a, b = x[..., : hd // 2], x[..., hd // 2 :]
        return np.concatenate([a * cos - b * sin, b * cos + a * sin], axis=-1)

    group = cfg.num_heads // cfg.num_kv_heads
    causal = np.tril(np.ones((num_tokens, num_tokens), bool))
    x = w(model.embed_tokens)[tokens]
    for layer in model.layers:
        h = rms(x, w(layer.input_layernorm.scale))
        q = rope(proj(layer.q_proj, h, "td,dnk->tnk"))
        k = rope(proj(layer.k_proj, h, "td,dnk->tnk"))
        v = proj(layer.v_proj, h, "td,dnk->tnk")
        out = np.empty_like(q)
        for head in range(cfg.num_heads):
            kv = head // group
            scores = q[:, head] @ k[:, kv].T / np.sqrt(hd)
            scores = np.where(causal, scores, -np.inf)
            probs = np.exp(scores - scores.max(-1, keepdims=True))
            out[:, head] = (probs / probs.sum(-1, keepdims=True)) @ v[:, kv]
        x = x + proj(layer.o_proj, out, "tnk,nkd->td")
        h = rms(x, w(layer.post_attention_layernorm.scale))
        gate, up = proj(layer.gate_proj, h, "td,df->tf"), proj(layer.up_proj, h, "td,df->tf")
        x = x + proj(layer.down_proj, gate / (1 + np.exp(-gate)) * up, "tf,fd->td")
    head = w(model.embed_tokens).T if model.lm_head is None else w(model.lm_head)
    return rms(x, w(model.norm.scale)) @ head
