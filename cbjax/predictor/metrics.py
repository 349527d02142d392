"""Kendall's rank correlation (tau-b) in numpy, for judging length predictors by the order they give."""

from __future__ import annotations

import numpy as np


def kendall_tau(x, y, chunk: int = 1024) -> float:
    """Kendall's tau-b of two equal-length sequences: O(n^2) time in row chunks, O(chunk * n) memory."""
    x = np.asarray(x, dtype=np.float64)
    y = np.asarray(y, dtype=np.float64)
    if x.shape != y.shape or x.ndim != 1:
        raise ValueError(f"kendall_tau needs two 1-d sequences of one length, got shapes {x.shape} and {y.shape}")
    concordance = untied_x = untied_y = 0.0
    for start in range(0, len(x), chunk):
        sx = np.sign(x[start : start + chunk, None] - x[None, :])  # [chunk, n]
        sy = np.sign(y[start : start + chunk, None] - y[None, :])
        concordance += float((sx * sy).sum())
        untied_x += float(np.count_nonzero(sx))
        untied_y += float(np.count_nonzero(sy))
    if untied_x == 0 or untied_y == 0:
        return float("nan")
    return concordance / np.sqrt(untied_x * untied_y)
