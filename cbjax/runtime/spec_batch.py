"""Plan -> the host arrays of speculative decoding (pure numpy): the drafts a step verifies, and
where a drafter's one-token passes run (`cbjax.runtime.draft`).

A plan row with `num_drafts` = d > 0 ends in d drafts (`ScheduledRequest.num_drafts`). Host
proposals (n-gram) arrive as the row's last d token ids; with a drafter on the device the plan
holds only the row's first num_new_tokens - d ids, the packer pads the row with zeros, and the
step writes the device's drafts there (`cbjax.runtime.verify.place_drafts`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np

from cbjax.core.plan import ScheduledRequest
from cbjax.layout.tiles import BLOCK_Q, build_tiles


@dataclass
class HostSpec:
    """A step's speculative inputs; R is the slot count, k the most drafts per row."""

    num_drafts: np.ndarray  # i32[R]
    drafts: np.ndarray  # i32[R, k]: host-proposed ids; 0 past num_drafts and where the device drafts
    last_pos: np.ndarray  # i32[R]: each row's last non-draft position (idle rows 0)
    last_token: np.ndarray  # i32[R]: its id (0 where the plan has none)
    num_rows: np.int32  # rows in use
    pass_tiles: Optional[tuple]  # the one-token passes' query groups (grouped attention backends)


def check_row(s: ScheduledRequest, k: int, on_device: bool, one_token: bool) -> int:
    """How many of the row's token ids the plan must carry; a ValueError naming the request
    when its drafts do not fit this executor."""
    d = s.num_drafts
    if d == 0:
        return s.num_new_tokens
    if d > k:
        raise ValueError(f"request {s.request_id}: {d} drafts, spec.num_tokens is {k}")
    if d >= s.num_new_tokens:
        raise ValueError(f"request {s.request_id}: {d} drafts in a row of {s.num_new_tokens} tokens")
    if one_token and s.num_new_tokens - d != 1:
        raise ValueError(
            f"request {s.request_id}: drafts with spec.draft_layers need a decode row (one token before "
            f"its drafts), got {s.num_new_tokens - d}"
        )
    return s.num_new_tokens - d if on_device else s.num_new_tokens


def pack_spec(
    entries: Sequence[ScheduledRequest],
    chunks: Sequence[Sequence[int]],  # each row's token ids as packed (drafts last)
    k: int,
    kv_lens: np.ndarray,  # i32[R]
    page_size: int,
    capacity: Optional[tuple],  # the one-token layout's tile capacity (grouped backends), else None
) -> HostSpec:
    num_rows = kv_lens.shape[0]
    used = len(entries)
    num_drafts = np.zeros(num_rows, np.int32)
    drafts = np.zeros((num_rows, k), np.int32)
    last_token = np.zeros(num_rows, np.int32)
    for i, (s, ids) in enumerate(zip(entries, chunks)):
        d = s.num_drafts
        num_drafts[i] = d
        if len(ids) == s.num_new_tokens and len(ids) > d:
            if d:
                drafts[i, :d] = ids[-d:]
            last_token[i] = ids[len(ids) - d - 1]
    last_pos = np.where(kv_lens > 0, kv_lens - num_drafts - 1, 0).astype(np.int32)
    tiles = None
    if capacity is not None:
        query_start = np.minimum(np.arange(num_rows + 1), used).astype(np.int32)
        reach = np.where(kv_lens > 0, last_pos + num_drafts + 1, 0).astype(np.int32)  # the passes' furthest reach
        tiles = build_tiles(query_start, reach, num_rows, page_size, BLOCK_Q, capacity)
    return HostSpec(num_drafts, drafts, last_pos, last_token, np.int32(used), tiles)
