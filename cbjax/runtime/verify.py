"""Speculative verification: which drafts a row accepts, and the target's token after them.

A row verifying d drafts x_1 .. x_d (d <= k, `num_drafts`) has the target's logits at d + 1
positions: position j (0..d) follows the row's j-th token (its last non-draft token, then the
drafts), so it checks x_{j+1} and, once the drafts before it are accepted, decides the token
after them. Row r emits its `num_accepted` accepted drafts, then one token of the target's own
(the correction at the first rejection, or the bonus token after the last draft).

Greedy (temperature 0): accept the longest prefix of drafts equal to the target's argmax at
their positions; the target's argmax after them is the next token. The emitted tokens are then
the target's argmaxes at positions 0..num_accepted, what decoding without drafts emits.

Sampling (temperature > 0): speculative rejection sampling (Leviathan et al. 2023; Chen et al.
2023). p_j is the target's distribution at position j after the row's temperature, top-k and
top-p (what the sampler draws from); q_j the distribution x_{j+1} was drawn from (a draft
model's, after the same knobs; a host-proposed draft, an n-gram's, is one-hot). x_{j+1} is
accepted with probability min(1, p_j(x_{j+1}) / q_j(x_{j+1})); the first rejected position j
draws from norm(max(0, p_j - q_j)), and a row that accepts every draft draws its bonus from
p_d. Every emitted token then follows the target's distribution exactly.

Randomness: each decision's key derives from (request seed, index of the token it decides),
as `cbjax.runtime.sampling` does, salted by its use (`ACCEPT`, `RESIDUAL`, `DRAFT`). The bonus
draw is unsalted: a row without drafts samples exactly as the sampler does.

Packed result, one i32[R, k + 2] array per step (the one device->host copy): column 0 the
number of accepted drafts n, columns 1 .. n + 1 the emitted tokens; -1 where the logits that
decided the last one were not finite.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from cbjax.model.ops import first_argmax
from cbjax.runtime.sampling import top_k_top_p

ACCEPT, RESIDUAL, DRAFT = 1, 2, 3  # salts of a token index's key, by use


def token_key(seed: jax.Array, index: jax.Array, salt: int = 0) -> jax.Array:
    """The key of the decision about token `index` of a request seeded `seed` (scalars); salt
    0 is the sampler's own key (`cbjax.runtime.sampling.sample`)."""
    key = jax.random.fold_in(jax.random.key(seed), index)
    return key if salt == 0 else jax.random.fold_in(key, salt)


def verify_rows(logits_idx: jax.Array, num_drafts: jax.Array, kv_lens: jax.Array, k: int, num_tokens: int):
    """Where the LM head runs in a step verifying drafts.

    logits_idx i32[R] (each row's last flat token), num_drafts i32[R], kv_lens i32[R] (0: idle
    row) -> (entry_idx i32[S], gather i32[R, k + 1], live i32[]): the flat tokens whose logits
    are needed, compactly in row order (row r's last num_drafts[r] + 1 tokens), with S =
    min(R * (k + 1), num_tokens) (a step of T tokens needs at most T); gather[r, j] is the
    entry of row r's position j (its last one past num_drafts[r]); live: entries in use."""
    num_rows = logits_idx.shape[0]
    size = min(num_rows * (k + 1), num_tokens)
    count = jnp.where(kv_lens > 0, num_drafts + 1, 0)
    start = jnp.cumsum(count) - count
    j = jnp.arange(k + 1, dtype=jnp.int32)[None, :]
    valid = (kv_lens > 0)[:, None] & (j <= num_drafts[:, None])
    flat = logits_idx[:, None] - num_drafts[:, None] + j
    slot = jnp.where(valid, start[:, None] + j, size)  # `size`: dropped
    entry_idx = jnp.zeros(size, jnp.int32).at[slot.ravel()].set(flat.ravel(), mode="drop")
    gather = jnp.minimum(start[:, None] + jnp.minimum(j, num_drafts[:, None]), size - 1)
    return entry_idx, gather, jnp.sum(count)


def place_drafts(tokens: jax.Array, logits_idx: jax.Array, num_drafts: jax.Array, drafts: jax.Array) -> jax.Array:
    """tokens i32[T] with row r's drafts i32[R, k] in its last num_drafts[r] slots (ending at
    logits_idx[r]): drafts a draft model proposed on the device enter the step's buffer here."""
    k = drafts.shape[1]
    j = jnp.arange(k, dtype=jnp.int32)[None, :]
    idx = logits_idx[:, None] - num_drafts[:, None] + 1 + j
    idx = jnp.where(j < num_drafts[:, None], idx, tokens.shape[0])  # out of range: dropped
    return tokens.at[idx.ravel()].set(drafts.ravel(), mode="drop")


def greedy_verify(target: jax.Array, drafts: jax.Array, num_drafts: jax.Array) -> jax.Array:
    """target i32[R, k + 1] (the argmax at each position, -1 where not finite), drafts i32[R, k],
    num_drafts i32[R] -> the packed result i32[R, k + 2] (module docstring)."""
    k = drafts.shape[1]
    ok = (drafts == target[:, :k]) & (jnp.arange(k)[None, :] < num_drafts[:, None])
    num_accepted = jnp.sum(jnp.cumprod(ok.astype(jnp.int32), axis=1), axis=1)
    return jnp.concatenate([num_accepted[:, None].astype(jnp.int32), target.astype(jnp.int32)], axis=1)


def target_probs(logits: jax.Array, temperature: jax.Array, top_k: jax.Array, top_p: jax.Array):
    """(filtered logits, probabilities) f32[R, P, V] of logits f32[R, P, V] after each row's
    temperature (0 read as 1), top-k and top-p: what the sampler draws from at each position."""
    num_rows, num_pos, vocab = logits.shape
    temp = jnp.where(temperature > 0, temperature, 1.0)
    scaled = (logits / temp[:, None, None]).reshape(num_rows * num_pos, vocab)
    rep = lambda a: jnp.repeat(a, num_pos)  # noqa: E731  each row's knob at each position
    on = jnp.any(top_k > 0) | jnp.any(top_p < 1)
    filtered = jax.lax.cond(on, top_k_top_p, lambda x, *_: x, scaled, rep(top_k), rep(top_p))
    filtered = filtered.reshape(num_rows, num_pos, vocab)
    return filtered, jax.nn.softmax(filtered, axis=-1)


def sample_verify(
    logits: jax.Array,  # f32[R, k + 1, V]: the target's at each position
    drafts: jax.Array,  # i32[R, k]
    num_drafts: jax.Array,  # i32[R]
    draft_probs,  # f32[R, k, V]: q_j of each draft; None: one-hot (host-proposed drafts)
    sampling: tuple,  # temperature f32[R], top_k i32[R], top_p f32[R], seed u32[R], index i32[R]
) -> jax.Array:  # i32[R, k + 2]
    """Rejection sampling for rows with temperature > 0, `greedy_verify` for the others; `index`
    is the index of the token position 0 decides (kv_lens - num_drafts)."""
    temperature, top_k, top_p, seeds, index = (jnp.asarray(a) for a in sampling)
    logits, drafts, num_drafts = jnp.asarray(logits), jnp.asarray(drafts), jnp.asarray(num_drafts)
    draft_probs = None if draft_probs is None else jnp.asarray(draft_probs)
    finite = jnp.all(jnp.isfinite(logits), axis=-1)  # bool[R, k + 1]
    greedy = jnp.where(finite, first_argmax(logits), -1)
    greedy_packed = greedy_verify(greedy, drafts, num_drafts)

    def sampled() -> jax.Array:
        num_rows, k = drafts.shape
        vocab = logits.shape[-1]
        filtered, p = target_probs(logits, temperature, top_k, top_p)
        j = jnp.arange(k)[None, :]
        idx = index[:, None] + jnp.arange(k + 1)[None, :]  # i32[R, k + 1]: the token each position decides
        safe = jnp.clip(drafts, 0, vocab - 1)
        px = jnp.take_along_axis(p[:, :k], safe[..., None], axis=-1)[..., 0]  # p_j(x_{j+1})
        qx = 1.0 if draft_probs is None else jnp.take_along_axis(draft_probs, safe[..., None], axis=-1)[..., 0]
        u = jax.vmap(jax.vmap(lambda s, i: jax.random.uniform(token_key(s, i, ACCEPT))))(
            jnp.broadcast_to(seeds[:, None], (num_rows, k)), idx[:, :k]
        )
        ok = (u * qx < px) & (j < num_drafts[:, None]) & finite[:, :k]
        n = jnp.sum(jnp.cumprod(ok.astype(jnp.int32), axis=1), axis=1)  # i32[R]
        rows = jnp.arange(num_rows)
        rejected = n < num_drafts
        at = jnp.minimum(n, k - 1)  # the rejected position (when one is)
        if draft_probs is None:
            q_at = jax.nn.one_hot(drafts[rows, at], vocab, dtype=p.dtype)
        else:
            q_at = draft_probs[rows, at]
        residual = jnp.maximum(p[rows, n] - q_at, 0.0)
        residual_logits = jnp.where(residual > 0, jnp.log(residual), -jnp.inf)
        # p_j == q_j to rounding leaves no residual mass: then draw from p_j
        residual_logits = jnp.where(jnp.any(residual > 0, axis=-1, keepdims=True), residual_logits, filtered[rows, n])
        final_logits = jnp.where(rejected[:, None], residual_logits, filtered[rows, n])
        salt = jnp.where(rejected, RESIDUAL, 0)
        noise = jax.vmap(lambda s, i, t: jax.random.gumbel(_salted(s, i, t), (vocab,)))(seeds, idx[rows, n], salt)
        final = first_argmax(final_logits + noise)
        final = jnp.where(finite[rows, n], final, -1)
        emitted = jnp.concatenate([drafts, jnp.zeros((num_rows, 1), drafts.dtype)], axis=1).at[rows, n].set(final)
        packed = jnp.concatenate([n[:, None].astype(jnp.int32), emitted.astype(jnp.int32)], axis=1)
        return jnp.where((temperature > 0)[:, None], packed, greedy_packed)

    return jax.lax.cond(jnp.any(temperature > 0), sampled, lambda: greedy_packed)


def _salted(seed, index, salt):
    """`token_key` with a traced salt (0: unsalted)."""
    key = jax.random.fold_in(jax.random.key(seed), index)
    data = jnp.where(salt == 0, jax.random.key_data(key), jax.random.key_data(jax.random.fold_in(key, salt)))
    return jax.random.wrap_key_data(data)


verify_sample_step = jax.jit(sample_verify)


def verify_reference(logits, drafts, num_drafts, draft_probs, sampling):
    """`sample_verify` (and, for rows with temperature 0, `greedy_verify`) row by row in numpy,
    with the same keys: the oracle the fused path is tested against. Returns i32[R, k + 2]."""
    import numpy as np

    logits, drafts, num_drafts = np.asarray(logits, np.float32), np.asarray(drafts), np.asarray(num_drafts)
    temperature, top_k, top_p, seeds, index = (np.asarray(a) for a in sampling)
    num_rows, k = drafts.shape
    vocab = logits.shape[-1]
    out = np.zeros((num_rows, k + 2), np.int32)
    for r in range(num_rows):
        d, finite = int(num_drafts[r]), np.isfinite(logits[r]).all(axis=-1)
        if temperature[r] == 0:
            target = [int(np.argmax(row)) if ok else -1 for row, ok in zip(logits[r], finite)]
            n = 0
            while n < d and drafts[r, n] == target[n]:
                n += 1
            out[r, 0], out[r, 1:] = n, target
            continue
        scaled = logits[r] / temperature[r]
        filtered = np.asarray(_filter(scaled, np.full(k + 1, top_k[r]), np.full(k + 1, top_p[r])))
        with np.errstate(over="ignore", invalid="ignore"):
            p = np.exp(filtered - filtered.max(axis=-1, keepdims=True))
            p /= p.sum(axis=-1, keepdims=True)

        def q(j, r=r):
            return np.eye(vocab, dtype=np.float32)[drafts[r, j]] if draft_probs is None else np.asarray(draft_probs[r, j])

        n = 0
        while n < d and finite[n]:
            x = int(drafts[r, n])
            u = float(_uniform(seeds[r], index[r] + n))
            if not u * q(n)[x] < p[n, x]:
                break
            n += 1
        final_logits, salt = filtered[n], 0
        if n < d:
            residual = np.maximum(p[n] - q(n), 0.0)
            if (residual > 0).any():
                with np.errstate(divide="ignore"):
                    final_logits = np.where(residual > 0, np.log(residual), -np.inf)
            salt = RESIDUAL
        noise = np.asarray(_gumbel(seeds[r], index[r] + n, salt, vocab))
        out[r, 0] = n
        out[r, 1 : 1 + n] = drafts[r, :n]
        out[r, 1 + n] = int(np.argmax(final_logits + noise)) if finite[n] else -1
    return out


# The oracle's draws, one scalar key at a time (jitted: eager jax.random dispatches op by op).
_filter = jax.jit(top_k_top_p)
_uniform = jax.jit(lambda seed, index: jax.random.uniform(token_key(seed, index, ACCEPT)))
_gumbel = jax.jit(lambda seed, index, salt, vocab: jax.random.gumbel(token_key(seed, index, salt), (vocab,)),
                  static_argnums=(2, 3))  # fmt: skip
