"""Ragged attention test cases: random paged batches and a float64 numpy oracle (no jax)."""

from __future__ import annotations

import numpy as np


def make_case(rows, *, num_kv_heads, group, head_dim=16, page_size=4, num_tokens=None, num_rows=None,
              max_pages=None, seed=0, nan_fill=True):  # fmt: skip
    """A batch from `rows`, a list of (kv_len, num_new) per row (num_new <= kv_len).

    Pages are a random permutation of 1..num_pages-1 (page 0 is the null page); unused pages
    and the tails of last pages are NaN when `nan_fill`. Returns a dict of numpy arrays:
    q [T, H, D], k_pages / v_pages [KVH, P, page_size, D] and the metadata fields of
    `cbjax.kernels.metadata.AttentionMetadata`, plus `dense_k` / `dense_v`: each row's
    keys in position order, for the oracle.
    """
    rng = np.random.default_rng(seed)
    num_heads = num_kv_heads * group
    num_rows = num_rows or len(rows)
    real_tokens = sum(n for _, n in rows)
    num_tokens = num_tokens or max(real_tokens, 1)
    assert real_tokens <= num_tokens and len(rows) <= num_rows
    need = [-(-kv // page_size) for kv, _ in rows]
    max_pages = max_pages or max(need + [1])
    num_pages = sum(need) + 3
    perm = rng.permutation(np.arange(1, num_pages))
    fill = np.nan if nan_fill else 0.0
    k_pages = np.full((num_kv_heads, num_pages, page_size, head_dim), fill, np.float32)
    v_pages = np.full_like(k_pages, fill)
    page_table = np.zeros((num_rows, max_pages), np.int32)
    if nan_fill:  # entries past a row's pages point at pages of other rows: never to be read
        page_table[:] = rng.integers(1, num_pages, size=page_table.shape)
    query_start = np.zeros(num_rows + 1, np.int32)
    kv_lens = np.zeros(num_rows, np.int32)
    token_row = np.zeros(num_tokens, np.int32)
    token_pos = np.full(num_tokens, -1, np.int32)
    dense_k, dense_v = [], []
    used = 0
    t = 0
    for r, (kv, n) in enumerate(rows):
        assert 0 <= n <= kv
        pages = perm[used : used + need[r]]
        used += need[r]
        page_table[r, : need[r]] = pages
        kk = rng.standard_normal((kv, num_kv_heads, head_dim)).astype(np.float32)
        vv = rng.standard_normal((kv, num_kv_heads, head_dim)).astype(np.float32)
        for p in range(kv):
            k_pages[:, pages[p // page_size], p % page_size] = kk[p]
            v_pages[:, pages[p // page_size], p % page_size] = vv[p]
        dense_k.append(kk)
        dense_v.append(vv)
        kv_lens[r] = kv
        token_row[t : t + n] = r
        token_pos[t : t + n] = np.arange(kv - n, kv)
        t += n
        query_start[r + 1] = t
    query_start[len(rows) + 1 :] = t
    q = rng.standard_normal((num_tokens, num_heads, head_dim)).astype(np.float32)
    return dict(q=q, k_pages=k_pages, v_pages=v_pages, page_table=page_table, query_start=query_start,
                kv_lens=kv_lens, token_row=token_row, token_pos=token_pos, dense_k=dense_k, dense_v=dense_v,
                num_real_tokens=real_tokens)  # fmt: skip


def oracle(case) -> np.ndarray:
    """float64 softmax attention of each real token over its row's keys [0, pos]; padding -> 0."""
    q = case["q"].astype(np.float64)
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = case["k_pages"].shape[0]
    group = num_heads // num_kv_heads
    out = np.zeros_like(q)
    for t in range(case["num_real_tokens"]):
        r, p = case["token_row"][t], case["token_pos"][t]
        k = case["dense_k"][r][: p + 1].astype(np.float64)  # [p+1, kv, d]
        v = case["dense_v"][r][: p + 1].astype(np.float64)
        for h in range(num_heads):
            s = k[:, h // group] @ q[t, h] / np.sqrt(head_dim)
            w = np.exp(s - s.max())
            out[t, h] = (w / w.sum()) @ v[:, h // group]
    return out


# Shapes that cover the contract: decode-only, prefill-only, mixed, a chunk continuing context,
# lengths at page boundaries (page_size 4), idle rows and padding tokens.
CASES = {
    "decode_only": [(1, 1), (4, 1), (5, 1), (13, 1)],
    "prefill_only": [(7, 7), (4, 4), (1, 1)],
    "mixed": [(9, 1), (8, 1), (6, 6), (3, 1), (12, 5)],
    "chunk_continuing_context": [(16, 4), (11, 3)],
    "page_boundaries": [(4, 1), (8, 4), (12, 8), (16, 16)],
}
