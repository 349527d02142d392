"""Per-slot sampling inside the jitted step: greedy, temperature, top-k and top-p as arrays."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def sample(
    logits: jax.Array,  # f32[num_slots, vocab_size]
    temperature: jax.Array,  # f32[num_slots]; 0 means greedy
    top_k: jax.Array,  # i32[num_slots]; 0 means off
    top_p: jax.Array,  # f32[num_slots]; 1 means off
    seeds: jax.Array,  # u32[num_slots]
    positions: jax.Array,  # i32[num_slots]: index of the token being generated in its sequence
) -> jax.Array:  # i32[num_slots]
    """One token per slot. The key derives from (seed, position) only, so a request's samples
    do not depend on its slot, its neighbours, or preemptions."""
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)

    def sampled() -> jax.Array:
        temp = jnp.where(temperature > 0, temperature, 1.0)
        scaled = logits / temp[:, None]
        filtered = jax.lax.cond(jnp.any(top_k > 0) | jnp.any(top_p < 1), top_k_top_p, lambda x, *_: x, scaled, top_k, top_p)
        keys = jax.vmap(lambda s, p: jax.random.fold_in(jax.random.key(s), p))(seeds, positions)
        draws = jax.vmap(jax.random.categorical)(keys, filtered).astype(jnp.int32)
        return jnp.where(temperature > 0, draws, greedy)

    # A batch of greedy requests skips the sort and the draws altogether.
    return jax.lax.cond(jnp.any(temperature > 0), sampled, lambda: greedy)


def top_k_top_p(
    scaled: jax.Array,  # f32[num_slots, vocab_size], temperature applied
    top_k: jax.Array,  # i32[num_slots]
    top_p: jax.Array,  # f32[num_slots]
) -> jax.Array:  # f32[num_slots, vocab_size], -inf outside each row's kept set
    vocab_size = scaled.shape[-1]
    desc = -jnp.sort(-scaled, axis=-1)  # largest first
    k = jnp.where(top_k > 0, jnp.minimum(top_k, vocab_size), vocab_size)
    kth = jnp.take_along_axis(desc, (k - 1)[:, None], axis=1)  # f32[num_slots, 1]
    desc = jnp.where(desc >= kth, desc, -jnp.inf)
    probs = jax.nn.softmax(desc, axis=-1)
    # keep the smallest prefix whose mass reaches top_p, and the first token always: a top_p
    # below f32's smallest normal reads as 0 where denormals flush to zero (XLA on CPU)
    before = jnp.cumsum(probs, axis=-1) - probs
    keep = (before < top_p[:, None]) | (jnp.arange(vocab_size) == 0)
    cutoff = jnp.min(jnp.where(keep, desc, jnp.inf), axis=-1, keepdims=True)
    return jnp.where((scaled >= cutoff) & (scaled >= kth), scaled, -jnp.inf)
