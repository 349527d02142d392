"""Prompt-lookup (n-gram) proposals: drafts copied from what followed an earlier occurrence of a
request's last tokens (no jax)."""

from __future__ import annotations

from typing import Sequence

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


def propose_ngram(token_ids: Sequence[int], k: int, ngram_min: int, ngram_max: int) -> tuple[int, ...]:
    """Up to `k` drafts for the tokens after `token_ids` (a request's prompt and output so far).

    For n from `ngram_max` down to `ngram_min`, the last n tokens are looked for earlier in the
    sequence; the first n that matches proposes the up to k tokens that followed its latest
    earlier occurrence (fewer when that occurrence is near the end). No match: no drafts."""
    length = len(token_ids)
    if k < 1 or length <= ngram_min:
        return ()
    ids = np.asarray(token_ids, dtype=np.int64)
    for n in range(min(ngram_max, length - 1), ngram_min - 1, -1):
        # windows starting at 0 .. length - 1 - n: each is followed by a token, and none is the suffix
        windows = sliding_window_view(ids[: length - 1], n)  # [length - n, n]
        hits = np.flatnonzero((windows == ids[length - n :]).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n
            return tuple(ids[start : start + k].tolist())
    return ()
