"""Train a length predictor with optax: ListMLE ranking loss (Fu et al. 2024) or log-length regression.

This module imports jax; the scheduler only loads the saved result (`LearnedPredictor`).
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import optax

from cbjax.predictor.features import NUM_FEATURES
from cbjax.predictor.learned import LearnedPredictor

LOSSES = ("listmle", "regression")


def _scores(params: dict, z: jax.Array) -> jax.Array:
    """z: f32[..., NUM_FEATURES] -> f32[...]"""
    return jnp.tanh(z @ params["w1"] + params["b1"]) @ params["w2"] + params["b2"]


def listmle_loss(scores: jax.Array) -> jax.Array:
    """ListMLE: -log P(the true order | scores) under Plackett-Luce, averaged over lists.

    scores: f32[num_lists, list_size], each row already in the true order, longest first.
    """
    size = scores.shape[-1]
    # suffix[..., i] = logsumexp(scores[..., i:]): lists are short, so mask a [size, size] square
    later = jnp.arange(size)[None, :] >= jnp.arange(size)[:, None]  # bool[size, size]
    suffix = jax.nn.logsumexp(jnp.where(later, scores[..., None, :], -jnp.inf), axis=-1)
    return jnp.mean(jnp.sum(suffix - scores, axis=-1))


def _loss(params: dict, z: jax.Array, log_lens: jax.Array, kind: str) -> jax.Array:
    s = _scores(params, z)
    if kind == "listmle":
        return listmle_loss(s)
    return jnp.mean((s - log_lens) ** 2)


@partial(jax.jit, static_argnames=("optimizer", "kind"))
def _train_step(params: dict, opt_state, z: jax.Array, log_lens: jax.Array, *, optimizer, kind: str):
    """z: f32[num_lists, list_size, NUM_FEATURES]; log_lens: f32[num_lists, list_size], rows
    of distinct requests, longest first. Returns the new params, optimizer state and loss."""
    value, grads = jax.value_and_grad(_loss)(params, z, log_lens, kind)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, value


def train_predictor(
    features: np.ndarray,
    output_lens: np.ndarray,
    vocab_size: int,
    *,
    loss: str = "listmle",
    hidden: int = 32,
    steps: int = 400,
    num_lists: int = 16,
    list_size: int = 64,
    learning_rate: float = 1e-2,
    seed: int = 0,
) -> LearnedPredictor:
    """features: f64[n, NUM_FEATURES] (NaN: unknown); output_lens: i64[n], each >= 1."""
    if loss not in LOSSES:
        raise ValueError(f"loss: unknown value {loss!r}; choose one of {', '.join(LOSSES)}")
    # each would train nothing (or the reverse order) and save the result without a word
    for name, value, least in (("hidden", hidden, 1), ("steps", steps, 1), ("num_lists", num_lists, 1),
                               ("list_size", list_size, 2)):  # fmt: skip
        if value < least:
            raise ValueError(f"{name} must be >= {least}, got {value}")
    if not learning_rate > 0 or not np.isfinite(learning_rate):
        raise ValueError(f"learning_rate must be a finite number > 0, got {learning_rate}")
    features = np.asarray(features, dtype=np.float64)
    if features.ndim != 2 or features.shape[1] != NUM_FEATURES or len(features) != len(output_lens):
        raise ValueError(
            f"features must be [n, {NUM_FEATURES}] with one row per output length, "
            f"got {features.shape} and {len(output_lens)} lengths"
        )
    if len(features) < 2:
        raise ValueError(f"a length predictor needs at least 2 training requests, got {len(features)}")
    mean = np.nanmean(features, axis=0)
    mean = np.where(np.isnan(mean), 0.0, mean)  # a statistic no request has
    x = np.where(np.isnan(features), mean, features)
    std = x.std(axis=0)
    std = np.where(std > 1e-8, std, 1.0)
    z = ((x - mean) / std).astype(np.float32)  # [n, F]
    log_lens = np.log(np.maximum(np.asarray(output_lens), 1)).astype(np.float32)  # [n]

    # numpy initialisation keeps compiles to two (init and step): startup is most of the cost
    rng = np.random.default_rng(seed)
    params = {
        "w1": rng.normal(size=(NUM_FEATURES, hidden)) / np.sqrt(NUM_FEATURES),
        "b1": np.zeros(hidden),
        "w2": rng.normal(size=hidden) / np.sqrt(hidden),
        "b2": np.zeros(()),
    }
    params = {k: v.astype(np.float32) for k, v in params.items()}
    optimizer = optax.adam(learning_rate)
    opt_state = jax.jit(optimizer.init)(params)
    n, size = len(z), min(list_size, len(z))
    for _ in range(steps):
        idx = np.stack([rng.choice(n, size, replace=False) for _ in range(num_lists)])  # [num_lists, size]
        idx = np.take_along_axis(idx, np.argsort(-log_lens[idx], axis=1, kind="stable"), axis=1)
        params, opt_state, _ = _train_step(params, opt_state, z[idx], log_lens[idx], optimizer=optimizer, kind=loss)

    params = {k: np.asarray(v, dtype=np.float64) for k, v in params.items()}
    predictor = LearnedPredictor(
        feature_mean=mean, feature_std=std, calibration=np.array([1.0, 0.0]), vocab_size=vocab_size, loss=loss, **params
    )
    # Map scores to log lengths by least squares, so that predictions are in tokens.
    s, target = predictor.scores(features), log_lens.astype(np.float64)
    predictor.calibration = np.polyfit(s, target, 1) if np.ptp(s) > 0 else np.array([0.0, target.mean()])
    return predictor
