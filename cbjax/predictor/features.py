"""Features of a prompt known at arrival: log length and token-id statistics (numpy only)."""

from __future__ import annotations

from typing import Optional, Sequence

import numpy as np

from cbjax.core.request import Request

NUM_BUCKETS = 16
# log1p(prompt_len), mean and std of token id / vocab_size, then the share of ids per bucket
NUM_FEATURES = 3 + NUM_BUCKETS


def prompt_features(token_ids: Optional[Sequence[int]], prompt_len: int, vocab_size: int) -> np.ndarray:
    """f64[NUM_FEATURES]. Without token ids the statistics are NaN (the model imputes them)."""
    out = np.full(NUM_FEATURES, np.nan)
    out[0] = np.log1p(prompt_len)
    if token_ids is not None and len(token_ids):
        ids = np.asarray(token_ids, dtype=np.int64)
        scaled = ids / vocab_size
        out[1] = scaled.mean()
        out[2] = scaled.std()
        buckets = np.clip(ids * NUM_BUCKETS // vocab_size, 0, NUM_BUCKETS - 1)
        out[3:] = np.bincount(buckets, minlength=NUM_BUCKETS) / len(ids)
    return out


def request_token_ids(request: Request) -> Optional[list[int]]:
    """The prompt's ids, drawing a length-only request's synthetic ids without keeping them on
    it (features read them once; kept, a long trace's prompts would all stay in memory); None
    if it has neither."""
    if request.prompt_token_ids is None and request.synthetic_prompt is None:
        return None
    return request.prompt_ids(keep=False)


def feature_matrix(requests: Sequence[Request], vocab_size: int) -> np.ndarray:
    """f64[num_requests, NUM_FEATURES] (no rows for no requests)"""
    rows = [prompt_features(request_token_ids(r), r.prompt_len, vocab_size) for r in requests]
    return np.stack(rows) if rows else np.zeros((0, NUM_FEATURES))
