"""Host-side query groups for the XLA ragged attention backend (pure numpy, no jax).

See `cbjax.kernels.xla_ragged` for how they are run. Row r's new tokens are flat tokens
[query_start[r], query_start[r + 1]) at positions [kv_lens[r] - n, kv_lens[r]). A one-token
row (a decode) is one group of the single list; a longer row is cut into groups of `block`
tokens in the block list. A group reads its row's pages 0 .. (its last position) // page_size.
Each list is sorted by that page count, longest first, and cut into chunks of a fixed number
of groups; a chunk's page count is its first group's, so groups of a chunk read about as many
pages each and little work is masked.

A step no larger than the slot array (T <= num_rows: decodes and small prefills) lists every
token as its own single group, reading its row's pages up to its own position, and has no
block list: its program compiles without the block pass and runs none of it.
"""

from __future__ import annotations

import functools
from typing import Sequence

import numpy as np

# Query tokens per group in the block list, and groups per loop chunk of each list (the block
# list's chunk shrinks in small buckets, see `block_chunk`).
BLOCK_Q = 64
CHUNK_SINGLE = 32
CHUNK_BLOCK = 8
# Pages each group reads per inner loop step, in the single and block lists.
PAGES_SINGLE = 2
PAGES_BLOCK = 4


def token_groups(num_tokens: int, num_rows: int) -> bool:
    """Whether a step of `num_tokens` tokens lists every token as a single group (no block list)."""
    return num_tokens <= num_rows


def tile_capacity(num_tokens: int, num_rows: int, block: int, chunks: tuple[int, int]) -> tuple[tuple[int, int], ...]:
    """Static ((capacity, chunk) single, (capacity, chunk) block) for a step of `num_tokens`
    tokens: the most groups any batch of that size can need, rounded up to whole chunks, and
    the chunk size, no more groups than the capacity needs. Under `token_groups` the single
    list holds a group per token and the block list is empty (capacity 0)."""
    if token_groups(num_tokens, num_rows):
        c = max(1, min(chunks[0], num_tokens))
        return ((-(-num_tokens // c) * c, c), (0, 1))
    block = group_size(num_tokens, block)
    single = min(num_tokens, num_rows)
    multi = min(num_tokens // 2, num_rows) + num_tokens // block  # rows of >= 2 tokens, plus full blocks
    out = []
    for n, c in ((single, chunks[0]), (multi, chunks[1])):
        c = max(1, min(c, n))
        out.append((max(c, -(-n // c) * c), c))
    return tuple(out)


def block_chunk(num_tokens: int) -> int:
    """Groups per chunk of the block list in a step of `num_tokens` tokens: one per 512 tokens,
    1 to CHUNK_BLOCK. A small step holds few prefill groups, and a chunk's unused groups cost as
    much as used ones (a mixed step of decodes and one prompt ran 2x slower with chunks of 8)."""
    return max(1, min(CHUNK_BLOCK, num_tokens // 512))


def group_size(num_tokens: int, block: int) -> int:
    """Query slots per block group in a step of `num_tokens` tokens: `block`, or fewer in a small
    bucket, whose rows can't hold more (a row of n <= num_tokens tokens splits the same way)."""
    return max(1, min(block, num_tokens))


def build_tiles(
    query_start: np.ndarray,  # i32[num_rows + 1]
    kv_lens: np.ndarray,  # i32[num_rows]
    num_tokens: int,
    page_size: int,
    block: int,
    capacity: tuple[tuple[int, int], ...],
) -> tuple[tuple[np.ndarray, ...], tuple[np.ndarray, ...]]:
    """(single, block) group lists, each (q_idx i32[cap, b], row i32[cap], chunk_pages
    i32[cap // chunk], num_chunks i32[]); unused query slots point at the padding row `num_tokens`.
    A block capacity of 0 (`tile_capacity` under `token_groups`) lists every token in the single list."""
    block = group_size(num_tokens, block)
    n = np.diff(query_start)
    starts = query_start[:-1]
    if capacity[1][0] == 0:
        total = int(query_start[-1])
        tok_row = np.repeat(np.arange(len(n)), n)
        pos = kv_lens[tok_row] - (query_start[tok_row + 1] - np.arange(total))  # each token's position
        single = _pack(np.arange(total)[:, None], tok_row, pos // page_size + 1, capacity[0], num_tokens)
        return single, _empty_list(block, capacity[1], num_tokens)
    rows1 = np.flatnonzero(n == 1)
    single = _pack(starts[rows1][:, None], rows1, (kv_lens[rows1] - 1) // page_size + 1, capacity[0], num_tokens)
    rows2 = np.flatnonzero(n >= 2)
    nblocks = -(-n[rows2] // block)
    block_row = np.repeat(rows2, nblocks)
    first_tok = starts[block_row] + _ranges(nblocks) * block  # flat index of each block's first token
    block_len = np.minimum(block, query_start[block_row + 1] - first_tok)
    last_pos = kv_lens[block_row] - (query_start[block_row + 1] - first_tok) + block_len - 1
    offs = np.arange(block)[None, :]
    q_idx = np.where(offs < block_len[:, None], first_tok[:, None] + offs, num_tokens)
    multi = _pack(q_idx, block_row, last_pos // page_size + 1, capacity[1], num_tokens)
    return single, multi


def group_pages(
    rows: Sequence[tuple[int, int]], page_size: int, num_tokens: int, num_rows: int
) -> tuple[list[int], list[int]]:
    """(single, block) pages each query group reads, longest first, for rows of
    (num_new_tokens, num_context_tokens) in a step of `num_tokens` (the bucket) over `num_rows`
    slots: a decode reads its row's pages up to its position, a prefill group of up to BLOCK_Q
    tokens those up to the group's last position; under `token_groups` each token is a group."""
    if token_groups(num_tokens, num_rows):
        return sorted(((ctx + i) // page_size + 1 for n, ctx in rows for i in range(n)), reverse=True), []
    single = sorted(((ctx // page_size + 1) for n, ctx in rows if n == 1), reverse=True)
    block = sorted(
        ((ctx + min(first + BLOCK_Q, n) - 1) // page_size + 1  # pages up to the group's last position
         for n, ctx in rows if n >= 2 for first in range(0, n, BLOCK_Q)),
        reverse=True,
    )  # fmt: skip
    return single, block


def count_steps(
    rows: Sequence[tuple[int, int]], page_size: int, num_tokens: int, num_rows: int
) -> tuple[int, int, int, int]:
    """(single chunks, single page steps, block chunks, block page steps) the kernel runs for
    rows of (num_new_tokens, num_context_tokens) in a step of `num_tokens` (the bucket) over
    `num_rows` slots as `build_tiles` lays them out, with the packer's chunks."""
    return steps_of(*group_pages(rows, page_size, num_tokens, num_rows), num_tokens)


def steps_of(single: list[int], block: list[int], num_tokens: int) -> tuple[int, int, int, int]:
    """`count_steps` from `group_pages`' lists. A chunk shrunk to its list's capacity holds every
    group of the list, so only the block list's `block_chunk` depends on the bucket."""
    out = []
    for pages, chunk, step in ((single, CHUNK_SINGLE, PAGES_SINGLE), (block, block_chunk(num_tokens), PAGES_BLOCK)):
        heads = pages[::chunk]  # each chunk runs as many steps as its first (longest) group needs
        out += [len(heads), sum(-(-p // step) for p in heads)]
    return tuple(out)


def _ranges(counts: np.ndarray) -> np.ndarray:
    """[0..c0), [0..c1), ... concatenated."""
    total = int(counts.sum())
    if total == 0:
        return np.zeros(0, np.int64)
    ends = np.cumsum(counts)
    return np.arange(total) - np.repeat(ends - counts, counts)


@functools.lru_cache(maxsize=None)
def _empty_list(block: int, capacity: tuple[int, int], num_tokens: int) -> tuple:
    """The empty group list of a step without a block list: the same read-only arrays every step
    (one per bucket), not eight numpy calls each."""
    none = np.zeros(0, np.int64)
    out = _pack(np.zeros((0, block), np.int64), none, none, capacity, num_tokens)
    for a in out[:3]:  # the last is a scalar
        a.flags.writeable = False
    return out


def _pack(q_idx, row, pages, capacity, num_tokens):
    cap, chunk = capacity
    num = len(row)
    if num > cap:
        raise ValueError(f"build_tiles: {num} query groups exceed the capacity {cap}; this is a bug in tile_capacity")
    order = np.argsort(-pages, kind="stable")
    out_q = np.full((cap, q_idx.shape[1]), num_tokens, np.int32)
    out_row = np.zeros(cap, np.int32)
    out_q[:num] = q_idx[order]
    out_row[:num] = row[order]
    num_chunks = -(-num // chunk)
    chunk_pages = np.zeros(cap // chunk, np.int32)
    chunk_pages[:num_chunks] = pages[order][::chunk]
    return out_q, out_row, chunk_pages, np.int32(num_chunks)
