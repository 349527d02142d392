"""Host-side tile lists for the XLA ragged attention backend (pure numpy, no jax).

See `cbjax.kernels.xla_ragged` for what a tile is. Row r's new tokens are flat tokens
[query_start[r], query_start[r + 1]) at positions [kv_lens[r] - n, kv_lens[r]). A one-token
row lists one single tile per page up to its position; a longer row is cut into blocks of
`block` tokens, each listing one tile per page up to the block's last position.
"""

from __future__ import annotations

import numpy as np

# Query tokens per tile in the block list, and tiles per loop step of each list.
BLOCK_Q = 16
CHUNK_SINGLE = 128
CHUNK_BLOCK = 32


def tile_capacity(
    num_tokens: int, num_rows: int, max_pages: int, block: int, chunks: tuple[int, int]
) -> tuple[int, int]:
    """Static (single, block) list capacities for a step of `num_tokens` tokens: the most tiles
    any batch of that size can need, each rounded up to whole chunks of its list."""
    single = min(num_tokens, num_rows) * max_pages
    blocks = min(num_tokens // 2, num_rows) + num_tokens // block  # rows of >= 2 tokens, plus full blocks
    multi = blocks * max_pages
    return tuple(max(c, -(-n // c) * c) for n, c in ((single, chunks[0]), (multi, chunks[1])))


def build_tiles(
    query_start: np.ndarray,  # i32[num_rows + 1]
    kv_lens: np.ndarray,  # i32[num_rows]
    page_table: np.ndarray,  # i32[num_rows, max_pages]
    num_tokens: int,
    page_size: int,
    block: int,
    capacity: tuple[int, int],
) -> tuple[tuple[np.ndarray, ...], tuple[np.ndarray, ...]]:
    """(single, block) tile lists, each (q_idx i32[cap, b], page i32[cap], page_pos i32[cap], num i32[]);
    unused tiles point their query rows at the padding row `num_tokens`."""
    n = np.diff(query_start)
    starts = query_start[:-1]
    one = n == 1
    # single tiles: pages 0 .. (kv - 1) // page_size of each one-token row
    rows1 = np.flatnonzero(one)
    count1 = (kv_lens[rows1] - 1) // page_size + 1
    tile_row1 = np.repeat(rows1, count1)
    pos1 = _ranges(count1)
    single = _pack(
        starts[tile_row1][:, None], page_table[tile_row1, pos1], pos1, capacity[0], 1, num_tokens
    )
    # block tiles: rows of >= 2 tokens cut into blocks
    rows2 = np.flatnonzero(n >= 2)
    nblocks = -(-n[rows2] // block)
    block_row = np.repeat(rows2, nblocks)
    block_idx = _ranges(nblocks)
    first_tok = starts[block_row] + block_idx * block  # flat index of each block's first token
    block_len = np.minimum(block, query_start[block_row + 1] - first_tok)
    last_pos = kv_lens[block_row] - (query_start[block_row + 1] - first_tok) + block_len - 1
    count2 = last_pos // page_size + 1
    tile_block = np.repeat(np.arange(len(block_row)), count2)
    pos2 = _ranges(count2)
    offs = np.arange(block)[None, :]
    q_idx = first_tok[tile_block][:, None] + offs
    q_idx = np.where(offs < block_len[tile_block][:, None], q_idx, num_tokens)
    multi = _pack(q_idx, page_table[block_row[tile_block], pos2], pos2, capacity[1], block, num_tokens)
    return single, multi


def _ranges(counts: np.ndarray) -> np.ndarray:
    """[0..c0), [0..c1), ... concatenated."""
    total = int(counts.sum())
    if total == 0:
        return np.zeros(0, np.int64)
    ends = np.cumsum(counts)
    return np.arange(total) - np.repeat(ends - counts, counts)


def _pack(q_idx, page, page_pos, capacity, block, num_tokens):
    num = len(page)
    if num > capacity:
        raise ValueError(f"build_tiles: {num} tiles exceed the capacity {capacity}; this is a bug in tile_capacity")
    out_q = np.full((capacity, block), num_tokens, np.int32)
    out_page = np.zeros(capacity, np.int32)
    out_pos = np.zeros(capacity, np.int32)
    out_q[:num] = q_idx
    out_page[:num] = page
    out_pos[:num] = page_pos
    return out_q, out_page, out_pos, np.int32(num)
