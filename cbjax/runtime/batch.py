"""Plan -> host arrays: pack one `Schedule` into the flat token buffer of a step (pure numpy).

Rows of the fixed slot array are filled in plan order (`plan.scheduled`), so row r's sampled
token is `plan.scheduled[r]`'s. Row r's new tokens are the plan's `token_ids` for it, laid out
contiguously in the flat buffer; the buffer is padded to the plan's token bucket. Under
pipelined serving a decode's token may not be on the host yet (the step that sampled it is
still running): the plan marks it `feed_previous`, and its slot in the buffer names that
step's output row instead (`feed`), from `prev_rows`. The packer keeps its own per-slot state
(page-table rows, sampling knobs), updated only from what the plan says changed, so a steady
decode step rewrites almost nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np

from cbjax.core.plan import Schedule, ScheduledRequest
from cbjax.core.request import SamplingParams
from cbjax.layout.shapes import ShapePlan
from cbjax.layout.tiles import BLOCK_Q, CHUNK_SINGLE, block_chunk, build_tiles, tile_capacity
from cbjax.runtime.spec_batch import HostSpec, check_row, pack_spec


@dataclass
class HostBatch:
    """One step's inputs, as numpy arrays; T is the token bucket, R the slot count."""

    tokens: np.ndarray  # i32[T]
    positions: np.ndarray  # i32[T]; padding 0
    write_idx: np.ndarray  # i32[T]: page * page_size + offset where each token's K/V goes; padding 0 (null page)
    page_table: np.ndarray  # i32[R, max_pages], row order
    query_start: np.ndarray  # i32[R + 1]
    kv_lens: np.ndarray  # i32[R]
    token_row: np.ndarray  # i32[T]
    token_pos: np.ndarray  # i32[T]; padding -1
    logits_idx: np.ndarray  # i32[R]: each row's last flat token (idle rows 0)
    feed: np.ndarray  # i32[T]: -1, or the previous step's output row whose token goes in this slot
    sampling: tuple[np.ndarray, ...]  # temperature f32[R], top_k i32[R], top_p f32[R], seed u32[R], position i32[R]
    tiles: Optional[tuple[tuple[np.ndarray, ...], tuple[np.ndarray, ...]]]  # XLA ragged backend only
    num_rows_used: int
    num_tokens_used: int
    spec: Optional[HostSpec] = None  # the drafts the step verifies (speculative decoding), else None


_I32_MAX = 2**31 - 1


class SamplingArrays:
    """Per-slot sampling knobs: f32 temperature, i32 top_k, f32 top_p, u32 seed."""

    def __init__(self, rows: int):
        self.temperature = np.zeros(rows, np.float32)
        self.top_k = np.zeros(rows, np.int32)
        self.top_p = np.ones(rows, np.float32)
        self.seed = np.zeros(rows, np.uint32)

    def set(self, row: int, sp: SamplingParams) -> None:
        self.temperature[row] = sp.temperature
        self.top_k[row] = min(sp.top_k, _I32_MAX)  # any k past the vocabulary keeps it whole
        self.top_p[row] = sp.top_p
        self.seed[row] = sp.seed & 0xFFFFFFFF


class BatchPacker:
    """Packs plans for one executor; keeps the per-slot buffers between steps."""

    def __init__(self, shapes: ShapePlan, *, tiles: bool, num_spec: int = 0, drafts_on_device: bool = False,
                 one_token_drafts: bool = False):  # fmt: skip
        """`num_spec`: k, the most drafts per row (0: no speculation); `drafts_on_device`: a
        drafter on the device proposes them (plans carry no draft ids); `one_token_drafts`: a
        drafting row must have one token before its drafts (self-speculation)."""
        self.shapes = shapes
        self.with_tiles = tiles
        self.num_spec, self.drafts_on_device, self.one_token_drafts = num_spec, drafts_on_device, one_token_drafts
        num_slots = shapes.num_rows
        self._slot_table = np.zeros((num_slots, shapes.max_pages), np.int32)  # i32[num_slots, max_pages]
        self._slot_sampling = SamplingArrays(num_slots)
        # The last step's row-order sampling knobs, reused while the same slots hold the same
        # requests (a steady decode step); a new request in any slot bumps the version.
        self._sampling_version = 0
        self._last_sampling: tuple = (None, None)
        # request id -> its row in the step launched last, whose tokens may not be on the host yet
        self.prev_rows: dict[str, int] = {}

    def capacity(self, bucket: int) -> tuple[tuple[int, int], ...]:
        """Static ((capacity, chunk) single, (capacity, chunk) block) groups for a step of `bucket` tokens."""
        return tile_capacity(bucket, self.shapes.num_rows, BLOCK_Q, (CHUNK_SINGLE, block_chunk(bucket)))

    def empty(self, bucket: int) -> HostBatch:
        """An all-padding batch of `bucket` tokens (warmup)."""
        return self._assemble(bucket, [], [], [], [])

    def pack(self, plan: Schedule) -> HostBatch:
        entries = plan.scheduled
        if len(entries) > self.shapes.num_rows:
            raise ValueError(f"pack: {len(entries)} scheduled requests exceed the {self.shapes.num_rows} slots")
        slots, starts, counts, chunks, fed = [], [], [], [], []
        for i, s in enumerate(entries):
            self._sync_slot(s)
            if s.feed_previous:  # sampled by the step still running: read from its output on the device
                chunks.append((0,))
                fed.append((i, self._prev_row(s.request_id)))
            elif s.num_drafts or self.num_spec:
                chunks.append(self._spec_ids(s))
            elif s.token_ids is None or len(s.token_ids) != s.num_new_tokens:
                raise ValueError(
                    f"pack: request {s.request_id} has no token ids for its {s.num_new_tokens} new tokens "
                    "(a plan for the engine carries them: Scheduler.plan_token_ids)"
                )
            else:
                chunks.append(s.token_ids)
            slots.append(s.slot)
            starts.append(s.num_computed)
            counts.append(s.num_new_tokens)
        total = sum(counts)
        return self._assemble(self.shapes.bucket(max(total, 1)), slots, starts, counts, chunks, fed, entries)

    def _spec_ids(self, s: ScheduledRequest) -> tuple[int, ...]:
        """A row's ids under speculation: as planned, zeros in the draft slots a device drafter fills."""
        want = check_row(s, self.num_spec, self.drafts_on_device, self.one_token_drafts)
        if s.token_ids is None or len(s.token_ids) != want:
            raise ValueError(
                f"pack: request {s.request_id} has {0 if s.token_ids is None else len(s.token_ids)} token ids, "
                f"expected {want} of its {s.num_new_tokens} new tokens ({s.num_drafts} drafts"
                f"{', proposed on the device' if self.drafts_on_device else ''})"
            )
        if want < s.num_new_tokens:
            return (*s.token_ids, *([0] * (s.num_new_tokens - want)))
        return s.token_ids

    def _prev_row(self, request_id: str) -> int:
        row = self.prev_rows.get(request_id)
        if row is None:
            raise RuntimeError(
                f"pack: request {request_id}'s last token is not on the host and it was not in "
                f"the step launched last; this is a bug"
            )
        return row

    def _assemble(self, bucket, slots, starts, counts, chunks, fed=(), entries=()) -> HostBatch:
        s = self.shapes
        num_rows, page_size = s.num_rows, s.page_size
        used = len(slots)
        counts_a = np.asarray(counts, np.int32)
        starts_a = np.asarray(starts, np.int32)
        query_start = np.zeros(num_rows + 1, np.int32)
        np.cumsum(counts_a, out=query_start[1 : used + 1])
        total = int(query_start[used])
        query_start[used + 1 :] = total
        kv_lens = np.zeros(num_rows, np.int32)
        kv_lens[:used] = starts_a + counts_a
        page_table = np.zeros((num_rows, s.max_pages), np.int32)
        page_table[:used] = self._slot_table[slots]
        tokens = np.zeros(bucket, np.int32)
        positions = np.zeros(bucket, np.int32)
        token_row = np.zeros(bucket, np.int32)
        token_pos = np.full(bucket, -1, np.int32)
        if used:
            if total == used:  # every row has one token: decodes
                tokens[:used] = [c[0] for c in chunks]
                positions[:used] = starts_a
                token_row[:used] = np.arange(used)
            else:
                tokens[:total] = np.concatenate([np.asarray(c, np.int32) for c in chunks])
                token_row[:total] = np.repeat(np.arange(used, dtype=np.int32), counts_a)
                positions[:total] = np.arange(total) - np.repeat(query_start[:used], counts_a) + starts_a[token_row[:total]]
            token_pos[:total] = positions[:total]
        row_pages = page_table[token_row[:total], positions[:total] // page_size]
        write_idx = np.zeros(bucket, np.int32)
        write_idx[:total] = row_pages * page_size + positions[:total] % page_size
        logits_idx = np.zeros(num_rows, np.int32)
        logits_idx[:used] = query_start[1 : used + 1] - 1
        feed = np.full(bucket, -1, np.int32)
        for row, prev in fed:
            feed[query_start[row]] = prev
        key = (self._sampling_version, tuple(slots))
        if self._last_sampling[0] != key:
            sp = self._slot_sampling
            knobs = (
                _rows(sp.temperature, slots, num_rows, 0.0),
                _rows(sp.top_k, slots, num_rows, 0),
                _rows(sp.top_p, slots, num_rows, 1.0),
                _rows(sp.seed, slots, num_rows, 0),
            )
            self._last_sampling = (key, knobs)
        spec = None
        if self.num_spec:
            capacity = self.capacity(num_rows) if self.with_tiles else None
            spec = pack_spec(entries, chunks, self.num_spec, kv_lens, page_size, capacity)
        # and the index of the token each row generates (its first, when it verifies drafts)
        sampling = (*self._last_sampling[1], kv_lens - spec.num_drafts if spec is not None else kv_lens.copy())
        tiles = None
        if self.with_tiles:
            tiles = build_tiles(query_start, kv_lens, bucket, page_size, BLOCK_Q, self.capacity(bucket))
        return HostBatch(
            tokens=tokens, positions=positions, write_idx=write_idx, page_table=page_table, query_start=query_start,
            kv_lens=kv_lens, token_row=token_row, token_pos=token_pos, logits_idx=logits_idx, feed=feed, sampling=sampling,
            tiles=tiles, num_rows_used=used, num_tokens_used=total, spec=spec,
        )  # fmt: skip

    def _sync_slot(self, s: ScheduledRequest) -> None:
        """Apply what the plan says changed in the slot: a new occupant's sampling knobs, a
        page-table row that grew or was replaced. Most steps change neither."""
        if s.sampling is not None:
            self._slot_sampling.set(s.slot, s.sampling)
            self._sampling_version += 1
        if s.page_table is not None:
            if len(s.page_table) > self.shapes.max_pages:
                raise ValueError(
                    f"request {s.request_id}: holds {len(s.page_table)} pages, the page table has {self.shapes.max_pages}"
                )
            row = self._slot_table[s.slot]
            row[:] = 0
            row[: len(s.page_table)] = s.page_table


def _rows(values: np.ndarray, slots: list[int], num_rows: int, fill) -> np.ndarray:
    out = np.full(num_rows, fill, values.dtype)
    out[: len(slots)] = values[slots]
    return out
