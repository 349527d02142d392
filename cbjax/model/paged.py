"""Paged KV cache and the two cached steps: batched prefill and one-token decode.

Both steps are pure and unjitted. The executor jits them once, at module level:

    decode = jax.jit(functools.partial(decode_step, cfg=cfg, attn_fn=attn_fn), donate_argnums=(1,))
    prefill_fn = jax.jit(functools.partial(prefill, cfg=cfg), donate_argnums=(1,))

so params are traced arguments and the cache is updated in place. Shapes are static per
(num_slots, max_pages_per_seq) and per prompt bucket; validity travels in `active`,
`lengths` and `positions`.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from cbjax.config import ModelConfig
from cbjax.kernels.paged_attention import AttentionFn
from cbjax.model.functional import Params, attention_out_and_mlp, attention_qkv, embed, lm_logits
from cbjax.model.llama import check_supported, dense_attention

# Writes that belong to no sequence (inactive slots, prompt padding) land here; never read.
NULL_PAGE = 0


@functools.partial(jax.tree_util.register_dataclass, data_fields=["k", "v"], meta_fields=[])
@dataclasses.dataclass(frozen=True)
class KVCache:
    """K and V pages for every layer, in the `cbjax.kernels.paged_attention` layout."""

    k: jax.Array  # [num_layers, num_kv_heads, num_pages, page_size, head_dim]
    v: jax.Array  # [num_layers, num_kv_heads, num_pages, page_size, head_dim]

    @property
    def num_pages(self) -> int:
        return self.k.shape[2]

    @property
    def page_size(self) -> int:
        return self.k.shape[3]


def init_cache(cfg: ModelConfig, num_pages: int, page_size: int) -> KVCache:
    """A zeroed cache in cfg.dtype. Page 0 is the null page, so num_pages - 1 are usable."""
    if num_pages < 2 or page_size < 1:
        raise ValueError(f"init_cache: need num_pages >= 2 and page_size >= 1, got {num_pages}, {page_size}")
    shape = (cfg.num_layers, cfg.num_kv_heads, num_pages, page_size, cfg.head_dim)
    return KVCache(k=jnp.zeros(shape, cfg.dtype), v=jnp.zeros(shape, cfg.dtype))


def _write(
    pages: jax.Array,  # [num_layers, num_kv_heads, num_pages, page_size, head_dim]
    layer_idx: int,
    page_ids: jax.Array,  # i32[n]
    offsets: jax.Array,  # i32[n]
    new: jax.Array,  # [n, num_kv_heads, head_dim]
) -> jax.Array:
    # Integer and array indices split by a slice: numpy puts the indexed dim [n] first.
    return pages.at[layer_idx, :, page_ids, offsets].set(new.astype(pages.dtype))


def _check_cache(cache: KVCache, cfg: ModelConfig, where: str) -> None:
    expected = (cfg.num_layers, cfg.num_kv_heads, cache.num_pages, cache.page_size, cfg.head_dim)
    if cache.k.shape != expected or cache.v.shape != expected:
        raise ValueError(
            f"{where}: cache k {cache.k.shape} / v {cache.v.shape} do not match the model, want {expected}"
        )


def decode_step(
    params: Params,
    cache: KVCache,
    tokens: jax.Array,  # i32[num_slots]
    positions: jax.Array,  # i32[num_slots], the position of `tokens` in each sequence
    page_table: jax.Array,  # i32[num_slots, max_pages_per_seq]
    active: jax.Array,  # bool[num_slots]
    cfg: ModelConfig,
    attn_fn: AttentionFn,
) -> tuple[jax.Array, KVCache]:  # logits f32[num_slots, vocab_size], the updated cache
    """Append one token per active slot to its pages and attend over positions [0, position].

    Active slots need positions < max_pages_per_seq * page_size and pages allocated up to
    positions // page_size. Inactive slots write to the null page, attend over length 0,
    and their logits are meaningless.
    """
    num_slots = tokens.shape[0]
    if tokens.shape != (num_slots,) or positions.shape != (num_slots,) or active.shape != (num_slots,):
        raise ValueError(
            f"decode_step: tokens {tokens.shape}, positions {positions.shape} and active {active.shape} "
            "must all be [num_slots]"
        )
    if page_table.ndim != 2 or page_table.shape[0] != num_slots:
        raise ValueError(
            f"decode_step: page_table {page_table.shape} must be [num_slots={num_slots}, max_pages_per_seq]"
        )
    check_supported(cfg)
    _check_cache(cache, cfg, "decode_step")
    page_size = cache.page_size
    positions = jnp.where(active, positions, 0)
    page_ids = jnp.take_along_axis(page_table, (positions // page_size)[:, None], axis=1)[:, 0]
    page_ids = jnp.where(active, page_ids, NULL_PAGE)  # i32[num_slots]
    offsets = positions % page_size  # i32[num_slots]
    lengths = jnp.where(active, positions + 1, 0)  # i32[num_slots]

    k_pages, v_pages = cache.k, cache.v
    x = embed(params, tokens)  # [num_slots, d_model]
    for layer_idx, layer in enumerate(params["layers"]):
        q, k, v = attention_qkv(layer, x, positions, cfg)  # q [num_slots, num_heads, head_dim]
        k_pages = _write(k_pages, layer_idx, page_ids, offsets, k)
        v_pages = _write(v_pages, layer_idx, page_ids, offsets, v)
        attn = attn_fn(q, k_pages[layer_idx], v_pages[layer_idx], page_table, lengths)
        x = attention_out_and_mlp(layer, x, attn, cfg)
    return lm_logits(params, x, cfg), KVCache(k=k_pages, v=v_pages)


def prefill(
    params: Params,
    cache: KVCache,
    tokens: jax.Array,  # i32[num_seqs, bucket_len], padded past each length
    lengths: jax.Array,  # i32[num_seqs]
    page_table: jax.Array,  # i32[num_seqs, max_pages_per_seq]
    cfg: ModelConfig,
    start: jax.Array | None = None,  # i32[num_seqs]: tokens already in the cache (None: 0)
) -> tuple[jax.Array, KVCache]:  # logits f32[num_seqs, vocab_size] at the last valid token, the updated cache
    """Process `lengths` tokens per sequence at positions start + t and store their K/V.

    Position p writes to page_table[seq, p // page_size] at p % page_size; padding writes to
    the null page. Without `start`, prompts run from position 0 with dense causal attention
    inside the bucket. With `start`, queries also attend to the sequence's cached tokens
    [0, start), read through its pages: a chunk of a longer prefill, or a prefill after a
    cached prefix. A row with length 0 is padding: its logits are meaningless.
    """
    if tokens.ndim != 2:
        raise ValueError(f"prefill: tokens must be [num_seqs, bucket_len], got {tokens.shape}")
    num_seqs, bucket_len = tokens.shape
    if lengths.shape != (num_seqs,) or (start is not None and start.shape != (num_seqs,)):
        raise ValueError(
            f"prefill: lengths {lengths.shape} and start {None if start is None else start.shape} "
            f"must be [num_seqs={num_seqs}] for tokens {tokens.shape}"
        )
    if page_table.ndim != 2 or page_table.shape[0] != num_seqs:
        raise ValueError(
            f"prefill: page_table {page_table.shape} must be [num_seqs={num_seqs}, max_pages_per_seq]"
        )
    check_supported(cfg)
    _check_cache(cache, cfg, "prefill")
    page_size = cache.page_size
    offsets_in_bucket = jnp.broadcast_to(jnp.arange(bucket_len), (num_seqs, bucket_len))
    valid = offsets_in_bucket < lengths[:, None]  # bool[num_seqs, bucket_len]
    positions = offsets_in_bucket if start is None else offsets_in_bucket + start[:, None]
    page_pos = jnp.where(valid, positions // page_size, 0)
    page_ids = jnp.where(valid, jnp.take_along_axis(page_table, page_pos, axis=1), NULL_PAGE).reshape(-1)
    offsets = (positions % page_size).reshape(-1)  # i32[num_seqs * bucket_len]
    if start is None:
        causal = jnp.tril(jnp.ones((bucket_len, bucket_len), bool))
        mask = causal[None] & valid[:, None, :]  # bool[num_seqs, bucket_len (query), bucket_len (key)]
    else:
        key_pos = jnp.arange(page_table.shape[1] * page_size)  # i32[max_len]
        key_valid = key_pos[None] < (start + lengths)[:, None]  # bool[num_seqs, max_len]
        mask = (key_pos[None, None] <= positions[:, :, None]) & valid[:, :, None]  # [num_seqs, bucket_len, max_len]

    k_pages, v_pages = cache.k, cache.v
    x = embed(params, tokens)  # [num_seqs, bucket_len, d_model]
    for layer_idx, layer in enumerate(params["layers"]):
        q, k, v = attention_qkv(layer, x, positions, cfg)  # k [num_seqs, bucket_len, num_kv_heads, head_dim]
        k_pages = _write(k_pages, layer_idx, page_ids, offsets, k.reshape(num_seqs * bucket_len, *k.shape[2:]))
        v_pages = _write(v_pages, layer_idx, page_ids, offsets, v.reshape(num_seqs * bucket_len, *v.shape[2:]))
        if start is None:
            attn = dense_attention(q, k, v, mask)
        else:
            k_ctx = _gather_sequence(k_pages[layer_idx], page_table, key_valid)
            v_ctx = _gather_sequence(v_pages[layer_idx], page_table, key_valid)
            attn = dense_attention(q, k_ctx, v_ctx, mask)
        x = attention_out_and_mlp(layer, x, attn, cfg)
    last = x[jnp.arange(num_seqs), jnp.maximum(lengths - 1, 0)]  # [num_seqs, d_model]
    return lm_logits(params, last, cfg), KVCache(k=k_pages, v=v_pages)


def _gather_sequence(
    pages: jax.Array,  # [num_kv_heads, num_pages, page_size, head_dim], one layer
    page_table: jax.Array,  # i32[num_seqs, max_pages_per_seq]
    key_valid: jax.Array,  # bool[num_seqs, max_pages_per_seq * page_size]
) -> jax.Array:  # [num_seqs, max_pages_per_seq * page_size, num_kv_heads, head_dim]
    """Each sequence's cached K or V in position order; positions past its length are zero."""
    num_kv_heads, _, page_size, head_dim = pages.shape
    num_seqs, max_pages = page_table.shape
    seq = pages[:, page_table]  # [num_kv_heads, num_seqs, max_pages, page_size, head_dim]
    seq = seq.transpose(1, 2, 3, 0, 4).reshape(num_seqs, max_pages * page_size, num_kv_heads, head_dim)
    return jnp.where(key_valid[:, :, None, None], seq, jnp.zeros((), seq.dtype))
