"""Chained hashes of a token sequence's full pages: the prefix cache's keys (never imports jax)."""

from __future__ import annotations

from typing import Sequence

# The parent hash of a sequence's first page. A fixed int: hash(None) varies between runs
# before Python 3.12, and runs must be reproducible.
ROOT_HASH = 0


def chain_hashes(parent: int, token_ids: Sequence[int], page_size: int) -> list[int]:
    """Chained hashes of the full pages of `token_ids`: page i hashes (hash of page i-1, its ids).

    Equal hashes mean equal token prefixes up to a 64-bit collision (about n**2 / 2**64 for n
    cached pages), which this research allocator accepts, as vLLM does with Python's hash.
    """
    hashes = []
    for lo in range(0, len(token_ids) - page_size + 1, page_size):
        parent = hash((parent, tuple(token_ids[lo : lo + page_size])))
        hashes.append(parent)
    return hashes
