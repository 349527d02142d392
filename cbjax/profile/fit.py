"""Fitting a cost model's coefficients: non-negative least squares on relative error (pure numpy)."""

from __future__ import annotations

from typing import Optional, Sequence

import numpy as np

WEIGHTINGS = ("relative", "absolute", "mean_relative")


def nnls(a: np.ndarray, b: np.ndarray, max_iter: int = 500) -> np.ndarray:
    """argmin ||a x - b|| subject to x >= 0 (Lawson and Hanson's active-set method)."""
    m, n = a.shape
    x = np.zeros(n)
    free = np.zeros(n, bool)
    tol = 10 * np.finfo(float).eps * np.linalg.norm(a, 1) * max(m, n)
    for _ in range(max_iter):
        grad = a.T @ (b - a @ x)
        if free.all() or np.max(np.where(free, -np.inf, grad)) <= tol:
            break
        free[np.argmax(np.where(free, -np.inf, grad))] = True
        while True:
            z = np.zeros(n)
            z[free] = np.linalg.lstsq(a[:, free], b, rcond=None)[0]
            if np.all(z[free] > 0):
                x = z
                break
            # step from x toward z until the first free coefficient reaches zero; drop it
            blocked = free & (z <= 0)
            alpha = np.min(x[blocked] / (x[blocked] - z[blocked]))
            x = x + alpha * (z - x)
            free &= x > tol
            x[~free] = 0.0
    return x


def fit_costs(
    features: Sequence[Sequence[float]],
    times: Sequence[float],
    offsets: Optional[Sequence[float]] = None,
    relative: bool = True,
    weighting: Optional[str] = None,
) -> np.ndarray:
    """Non-negative coefficients c minimising the relative error of offsets + features @ c against
    `times` (each row weighted by 1 / its time, so a 1 ms step counts as much as a 100 ms one),
    or with `relative=False` the absolute error (what a sum of the times sees: a 100 ms step
    counts as much as a hundred 1 ms ones); `offsets` are costs known beforehand (default 0).

    `weighting` (one of WEIGHTINGS) overrides `relative`: "relative", "absolute", or
    "mean_relative", squared errors weighted by 1 / time (rows by 1 / sqrt(time)), whose normal
    equations make the mean signed relative error zero over the rows of any indicator term (a
    bucket's own intercept) that stays positive: the estimator of a residual table that reports
    mean signed relative error. (Least squares on relative error leaves that mean negative, on
    absolute error positive, by how much the times spread.)"""
    x = np.asarray(features, float)  # f64[num_points, num_terms]
    y = np.asarray(times, float)  # f64[num_points]
    off = np.zeros(len(y)) if offsets is None else np.asarray(offsets, float)  # f64[num_points]
    if x.ndim != 2 or len(x) != len(y) or len(y) == 0:
        raise ValueError(f"fit_costs: features {x.shape} and times {y.shape} must be [n, terms] and [n], n >= 1")
    if np.any(y <= 0):
        raise ValueError("fit_costs: times must be > 0")
    if weighting is None:
        weighting = "relative" if relative else "absolute"
    if weighting not in WEIGHTINGS:
        raise ValueError(f"fit_costs: weighting must be one of {', '.join(WEIGHTINGS)}, got {weighting!r}")
    w = {"relative": 1.0 / y, "absolute": np.full(len(y), 1.0 / y.mean()),
         "mean_relative": 1.0 / np.sqrt(y * y.mean())}[weighting]  # fmt: skip
    a = x * w[:, None]
    scale = np.max(np.abs(a), axis=0)
    scale[scale == 0] = 1.0  # a term no point exercises fits to 0
    return nnls(a / scale, (y - off) * w) / scale
