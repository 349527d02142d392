"""The old engine's paged prefill + decode (dict params) must reproduce the NNX dense forward."""

from __future__ import annotations

import collections
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from llama_fixtures import QWEN_LIKE, TINY, dense, scaled_llama

from cbjax.config import ModelConfig
from cbjax.kernels.paged_attention import attention_op
from cbjax.model import KVCache, decode_step, prefill
from cbjax.model.functional import fuse_projections, params_from_model

# f32 throughout; the cached path only reorders sums (and, for pallas, runs an online softmax).
LOGITS_ATOL = 1e-4
LOGITS_RTOL = 1e-4

PAGE_SIZE = 4
NUM_PAGES = 24
MAX_PAGES_PER_SEQ = 4  # 16 positions per slot
BUCKET_LEN = 8
NUM_STEPS = 6


# Traces per (config, impl, step); a retrace after the first call is a recompile.
_TRACES: collections.Counter = collections.Counter()


def _counted(fn, key):
    def traced(*args, **kwargs):
        _TRACES[key] += 1
        return fn(*args, **kwargs)

    return traced


@functools.lru_cache(maxsize=None)
def _steps(name: str, impl: str):
    """Jitted (prefill, decode) built the way an executor should: cfg static, cache donated."""
    cfg = {"tiny": TINY, "qwen_like": QWEN_LIKE}[name]
    prefill_fn = jax.jit(functools.partial(_counted(prefill, (name, impl, "prefill")), cfg=cfg), donate_argnums=(1,))
    decode_fn = jax.jit(
        functools.partial(_counted(decode_step, (name, impl, "decode")), cfg=cfg, attn_fn=attention_op(impl)),
        donate_argnums=(1,),
    )
    model = scaled_llama(cfg)  # the NNX model; the dense oracle runs it
    return cfg, model, params_from_model(model), prefill_fn, decode_fn


def _nan_cache(cfg: ModelConfig) -> KVCache:
    """Every page, the null page included, starts as NaN: any read of an unwritten entry shows."""
    shape = (cfg.num_layers, cfg.num_kv_heads, NUM_PAGES, PAGE_SIZE, cfg.head_dim)
    return KVCache(k=jnp.full(shape, jnp.nan, cfg.dtype), v=jnp.full(shape, jnp.nan, cfg.dtype))


def _generate(name: str, impl: str, prompts, seed: int):
    """Prefill `prompts` (None: an idle slot) together, then greedy-decode NUM_STEPS tokens.

    Returns per slot the full token sequence and the logits that chose each new token.
    """
    cfg, model, params, prefill_fn, decode_fn = _steps(name, impl)
    rng = np.random.default_rng(seed)
    num_slots = len(prompts)
    page_table = rng.permutation(np.arange(1, NUM_PAGES))[: num_slots * MAX_PAGES_PER_SEQ]
    page_table = page_table.reshape(num_slots, MAX_PAGES_PER_SEQ).astype(np.int32)
    tokens = np.zeros((num_slots, BUCKET_LEN), np.int32)
    lengths = np.zeros(num_slots, np.int32)
    for slot, prompt in enumerate(prompts):
        if prompt is None:
            page_table[slot] = rng.integers(-3, 10**6, MAX_PAGES_PER_SEQ)  # idle: garbage table
        else:
            tokens[slot, : len(prompt)] = prompt
            lengths[slot] = len(prompt)
    active = lengths > 0

    logits, cache = prefill_fn(
        params, _nan_cache(cfg), jnp.asarray(tokens), jnp.asarray(lengths), jnp.asarray(page_table)
    )
    seqs = [list(p) if p is not None else [] for p in prompts]
    step_logits = [[] for _ in prompts]
    positions = lengths.copy()
    for step in range(NUM_STEPS + 1):
        logits = np.asarray(logits)
        next_tokens = logits.argmax(-1).astype(np.int32)
        for slot in np.flatnonzero(active):
            step_logits[slot].append(logits[slot])
            seqs[slot].append(int(next_tokens[slot]))
        if step == NUM_STEPS:
            break
        decode_positions = np.where(active, positions, 999).astype(np.int32)  # idle: garbage position
        logits, cache = decode_fn(
            params, cache, jnp.asarray(next_tokens), jnp.asarray(decode_positions),
            jnp.asarray(page_table), jnp.asarray(active),
        )
        positions += 1
    return cfg, model, seqs, [np.stack(x) if x else None for x in step_logits]


def _assert_logits_close(actual, expected):
    np.testing.assert_allclose(actual, expected, atol=LOGITS_ATOL, rtol=LOGITS_RTOL)


@pytest.mark.parametrize("name,impl", [("tiny", "reference"), ("qwen_like", "reference"), ("tiny", "pallas")])
def test_prefill_and_decode_match_dense(name, impl):
    prompt = [7, 300, 42, 5, 511]
    cfg, model, seqs, step_logits = _generate(name, impl, [prompt, None], seed=1)
    # Position len(prompt) - 1 (prefill) and every decoded position after it.
    expected = dense(model, seqs[0][:-1])[len(prompt) - 1 :]
    assert step_logits[0].shape == expected.shape == (NUM_STEPS + 1, cfg.vocab_size)
    assert np.isfinite(step_logits[0]).all()
    _assert_logits_close(step_logits[0], expected)


def test_slots_batched_equal_slots_alone():
    prompts = [[1, 2, 3], [400, 17, 99, 250, 8, 61, 33]]
    _, _, seqs_together, logits_together = _generate("tiny", "reference", prompts, seed=2)
    for slot, prompt in enumerate(prompts):
        alone = [prompt if s == slot else None for s in range(len(prompts))]
        _, _, seqs_alone, logits_alone = _generate("tiny", "reference", alone, seed=3 + slot)
        assert seqs_alone[slot] == seqs_together[slot]
        _assert_logits_close(logits_together[slot], logits_alone[slot])
    # Three runs with new values but the same shapes: each step compiled exactly once.
    assert _TRACES[("tiny", "reference", "prefill")] == 1
    assert _TRACES[("tiny", "reference", "decode")] == 1


@pytest.mark.parametrize("cfg", [TINY, QWEN_LIKE], ids=["tiny", "qwen_like"])
def test_fused_projections_compute_the_same_model(cfg):
    """The old executor's serving layout (q/k/v and gate/up fused) gives the NNX model's logits."""
    model = scaled_llama(cfg)
    fused = fuse_projections(params_from_model(model))
    attn = fused["layers"][0]["self_attn"]
    q_dim, kv_dim = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    assert set(attn) == {"qkv_proj", "o_proj"} and attn["qkv_proj"]["weight"].shape == (cfg.d_model, q_dim + 2 * kv_dim)
    assert ("bias" in attn["qkv_proj"]) == cfg.attention_bias
    assert set(fused["layers"][0]["mlp"]) == {"gate_up_proj", "down_proj"}
    tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, 12).astype(np.int32)
    prefill_fn = jax.jit(functools.partial(prefill, cfg=cfg))
    page_table = np.arange(1, 5, dtype=np.int32)[None]
    logits, _ = prefill_fn(fused, _nan_cache(cfg), tokens[None], np.array([12], np.int32), page_table)
    _assert_logits_close(np.asarray(logits)[0], dense(model, tokens)[-1])


def test_bad_inputs_raise():
    cfg, _, params, _, _ = _steps("tiny", "reference")
    cache = _nan_cache(cfg)
    with pytest.raises(ValueError, match=r"page_table \(3, 4\) must be \[num_slots=2"):
        decode_step(params, cache, jnp.zeros(2, jnp.int32), jnp.zeros(2, jnp.int32), jnp.zeros((3, 4), jnp.int32),
                    jnp.ones(2, bool), cfg, attention_op("reference"))
    with pytest.raises(ValueError, match=r"lengths \(3,\) and start None must be \[num_seqs=2\]"):
        tokens, page_table = jnp.zeros((2, 8), jnp.int32), jnp.zeros((2, 4), jnp.int32)
        prefill(params, cache, tokens, jnp.zeros(3, jnp.int32), page_table, cfg)


def test_prefill_in_pieces_after_cached_context_matches_dense():
    # A prompt processed as three pieces at start 0, 5 and 9 (a chunked prefill, or a recompute
    # beyond the token budget) must leave the same logits and cache as one dense pass.
    cfg, model, params, _, decode_fn = _steps("tiny", "reference")
    chunk = jax.jit(lambda p, c, t, l, pt, st: prefill(p, c, t, l, pt, cfg, start=st))
    prompt = [9, 400, 3, 77, 250, 18, 6, 301, 44, 12, 500, 2]
    rng = np.random.default_rng(5)
    page_table = rng.permutation(np.arange(1, NUM_PAGES))[:MAX_PAGES_PER_SEQ][None].astype(np.int32)
    cache = _nan_cache(cfg)
    for lo, hi in ((0, 5), (5, 9), (9, len(prompt))):
        tokens = np.zeros((1, BUCKET_LEN), np.int32)
        tokens[0, : hi - lo] = prompt[lo:hi]
        logits, cache = chunk(params, cache, tokens, np.array([hi - lo], np.int32), page_table, np.array([lo], np.int32))
    want = dense(model, prompt)
    _assert_logits_close(np.asarray(logits)[0], want[-1])
    # the pieces' K/V in the pages serve a decode step exactly like the dense pass would
    nxt = int(want[-1].argmax())
    logits, cache = decode_fn(
        params, cache, jnp.asarray([nxt], jnp.int32), jnp.asarray([len(prompt)], jnp.int32),
        jnp.asarray(page_table), jnp.asarray([True]),
    )  # fmt: skip
    _assert_logits_close(np.asarray(logits)[0], dense(model, prompt + [nxt])[-1])
