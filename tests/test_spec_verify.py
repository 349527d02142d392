"""Speculative verification against its row-by-row oracle, and sampling's exactness (chi-square)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from cbjax.runtime.sampling import sample
from cbjax.runtime.verify import greedy_verify, verify_reference, verify_rows
from cbjax.runtime.verify import verify_sample_step as sample_verify  # the fused path, jitted as the engine runs it

sample = jax.jit(sample)


def _case(seed, num_rows=48, k=3, vocab=12, temperature=1.0, draft_model=False, top_k=0, top_p=1.0):
    """Random logits with drafts that often equal the argmax (so rows accept some and reject
    some), random draft counts, one row of NaN logits."""
    rng = np.random.default_rng(seed)
    logits = rng.normal(0, 2, (num_rows, k + 1, vocab)).astype(np.float32)
    drafts = rng.integers(0, vocab, (num_rows, k)).astype(np.int32)
    best = logits[:, :k].argmax(-1)
    agree = rng.random((num_rows, k)) < 0.6
    drafts = np.where(agree, best, drafts).astype(np.int32)
    num_drafts = rng.integers(0, k + 1, num_rows).astype(np.int32)
    logits[5, 1] = np.nan
    probs = None
    if draft_model:
        probs = rng.dirichlet(np.ones(vocab), (num_rows, k)).astype(np.float32)
    temp = np.where(rng.random(num_rows) < 0.25, 0.0, temperature).astype(np.float32)
    sampling = (
        temp, np.full(num_rows, top_k, np.int32), np.full(num_rows, top_p, np.float32),
        rng.integers(0, 2**32, num_rows, dtype=np.uint32), rng.integers(1, 100, num_rows).astype(np.int32),
    )  # fmt: skip
    return logits, drafts, num_drafts, probs, sampling


def _emitted(packed):
    """Per row: (num accepted, the emitted tokens)."""
    return [(int(row[0]), row[1 : 2 + row[0]].tolist()) for row in np.asarray(packed)]


@pytest.mark.parametrize("draft_model", [False, True])
@pytest.mark.parametrize("knobs", [{}, {"top_k": 5, "top_p": 0.9}])
def test_fused_verification_equals_the_row_by_row_oracle(draft_model, knobs):
    logits, drafts, num_drafts, probs, sampling = _case(1 + draft_model, draft_model=draft_model, **knobs)
    fused = sample_verify(jnp.asarray(logits), drafts, num_drafts, probs, sampling)
    oracle = verify_reference(logits, drafts, num_drafts, probs, sampling)
    got, want = _emitted(fused), _emitted(oracle)
    assert got == want
    counts = np.array([n for n, _ in want])
    temp = sampling[0]
    drafting = num_drafts > 0
    assert (counts[drafting] > 0).any() and (counts[drafting] < num_drafts[drafting]).any()  # accepts and rejects
    assert ((temp > 0) & (counts > 0)).any() and ((temp == 0) & (counts > 0)).any()
    assert want[5][1][-1] == -1 or want[5][0] < 1  # the NaN position never yields a token


def test_greedy_verification_accepts_the_longest_matching_prefix():
    target = np.array([[3, 4, 5, 6], [3, 9, 5, 6], [3, 4, 5, 6], [-1, 4, 5, 6]], np.int32)
    drafts = np.array([[3, 4, 5], [3, 4, 5], [3, 4, 5], [3, 4, 5]], np.int32)
    num_drafts = np.array([3, 3, 1, 3], np.int32)
    packed = np.asarray(greedy_verify(target, drafts, num_drafts))
    assert _emitted(packed) == [(3, [3, 4, 5, 6]), (1, [3, 9]), (1, [3, 4]), (0, [-1])]


def test_verify_rows_lay_out_each_rows_positions_compactly():
    # rows: 2 drafts ending at flat token 5, no drafts at 6, 1 draft at 9, then an idle row
    entry_idx, gather, live = verify_rows(
        jnp.array([5, 6, 9, 0]), jnp.array([2, 0, 1, 0]), jnp.array([10, 4, 7, 0]), k=2, num_tokens=10
    )
    assert np.asarray(entry_idx).tolist() == [3, 4, 5, 6, 8, 9, 0, 0, 0, 0]
    assert np.asarray(gather)[:3].tolist() == [[0, 1, 2], [3, 3, 3], [4, 5, 5]]
    assert int(live) == 6


# Sampling is exact: the first token a row emits follows the target's distribution whatever the
# drafts. Power (the contract, from the noncentral chi-square): N samples per arm in a 2 x V
# two-sample test at alpha = 1e-3; moving 5% of probability between two tokens of probability
# p_a, p_b <= 0.5 gives noncentrality lambda = (N / 2) * 0.05^2 * (1/p_a + 1/p_b) >= N / 200,
# and lambda >= 60 detects it with power > 0.99 at V - 1 <= 7 degrees of freedom (critical
# value 24.3, the noncentral mean 7 + lambda, sd sqrt(2 (7 + 2 lambda)) = 16). N = 16384 gives
# lambda >= 82.
N = 16384
VOCAB = 8
CRITICAL = stats.chi2.ppf(1 - 1e-3, VOCAB - 1)


def _chi_square(a: np.ndarray, b: np.ndarray) -> float:
    table = np.stack([np.bincount(a, minlength=VOCAB), np.bincount(b, minlength=VOCAB)])
    table = table[:, table.sum(0) > 0]
    return float(stats.chi2_contingency(table, correction=False)[0])


@pytest.mark.parametrize("proposal", ["ngram", "draft_model"])
def test_rejection_sampling_keeps_the_target_distribution(proposal):
    rng = np.random.default_rng(7)
    k = 2
    target = rng.normal(0, 1, (k + 1, VOCAB)).astype(np.float32)  # the same target logits in every row
    logits = np.broadcast_to(target, (N, k + 1, VOCAB))
    p0 = np.exp(target[0]) / np.exp(target[0]).sum()
    if proposal == "ngram":  # one-hot proposals: the same guess in every row, a likely token
        drafts = np.broadcast_to(np.argsort(p0)[-2], (N, k)).astype(np.int32)
        probs = None
    else:  # a draft model's distribution, unlike the target's; drafts drawn from it
        q = rng.dirichlet(np.ones(VOCAB) * 2, k).astype(np.float32)
        drafts = np.stack([rng.choice(VOCAB, N, p=q[j] / q[j].sum()) for j in range(k)], 1).astype(np.int32)
        probs = np.broadcast_to(q, (N, k, VOCAB))
    seeds = np.arange(N, dtype=np.uint32)
    index = np.full(N, 17, np.int32)
    knobs = (np.ones(N, np.float32), np.zeros(N, np.int32), np.ones(N, np.float32), seeds, index)
    packed = np.asarray(sample_verify(jnp.asarray(logits), drafts, np.full(N, k, np.int32), probs, knobs))
    first = packed[:, 1]
    accepted = packed[:, 0]
    assert 0.1 < (accepted > 0).mean() < 0.9  # drafts are accepted and rejected
    # speculation off: the sampler's own draws from the same logits, other seeds
    off_knobs = (*knobs[:3], seeds + np.uint32(N), index)
    off = np.asarray(sample(jnp.asarray(logits[:, 0]), *off_knobs))
    assert _chi_square(first, off) < CRITICAL
    # the test's power in practice: a 5% shift toward the draft is caught
    shifted = first.copy()
    move = np.flatnonzero(shifted != drafts[:, 0])[: int(0.05 * N)]
    shifted[move] = drafts[move, 0]
    assert _chi_square(shifted, off) > CRITICAL


def test_rows_without_drafts_sample_as_the_sampler_does():
    logits, _, _, _, sampling = _case(3, num_rows=32, k=2)
    logits = np.nan_to_num(logits)
    packed = np.asarray(sample_verify(jnp.asarray(logits), np.zeros((32, 2), np.int32), np.zeros(32, np.int32), None,
                                      sampling))  # fmt: skip
    plain = np.asarray(sample(jnp.asarray(logits[:, 0]), *sampling))
    assert (packed[:, 0] == 0).all() and (packed[:, 1] == plain).all()



@pytest.mark.parametrize("top_p", [1e-30, 1e-40, 1e-45])
def test_a_vanishing_top_p_keeps_only_the_most_likely_token(top_p):
    # 1e-40 and 1e-45 are f32 denormals, which XLA on CPU flushes to zero
    from cbjax.runtime.sampling import top_k_top_p

    logits = np.random.default_rng(0).normal(size=(3, 12)).astype(np.float32)
    out = np.asarray(top_k_top_p(jnp.asarray(logits), jnp.zeros(3, jnp.int32), jnp.full(3, top_p, jnp.float32)))
    assert (np.isfinite(out).sum(axis=1) == 1).all()
    assert np.isfinite(out[np.arange(3), logits.argmax(axis=1)]).all()


def test_a_top_k_past_the_vocabulary_keeps_it_whole():
    from cbjax.runtime.sampling import top_k_top_p

    logits = jnp.asarray(np.random.default_rng(1).normal(size=(2, 12)).astype(np.float32))
    ones = jnp.ones(2, jnp.float32)
    whole = top_k_top_p(logits, jnp.full(2, 2**31 - 1, jnp.int32), ones)
    assert (np.asarray(whole) == np.asarray(logits)).all()
