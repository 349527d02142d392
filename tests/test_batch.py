"""Plan -> host arrays, shape buckets and tile lists, checked by hand with no jax compile."""

from __future__ import annotations

import sys

import numpy as np
import pytest

from conftest import data_plan
from cbjax.core.plan import Schedule, ScheduledRequest
from cbjax.core.request import Request, SamplingParams
from cbjax.runtime.batch import BatchPacker
from cbjax.layout.shapes import default_token_buckets, plan_shapes
from cbjax.layout import tiles
from cbjax.layout.tiles import build_tiles, count_steps, tile_capacity


def req(rid, prompt, outputs, computed, new, slot, temperature=0.0):
    r = Request(request_id=rid, arrival_s=0.0, prompt_len=len(prompt), prompt_token_ids=list(prompt),
                sampling=SamplingParams(temperature=temperature, seed=7))  # fmt: skip
    r.output_token_ids = list(outputs)
    r.num_computed, r.num_new_tokens, r.slot = computed, new, slot
    return r


def test_default_token_buckets_by_hand():
    assert default_token_buckets(32, 8192) == [4, 8, 16, 24, 32, 64, 128, 256, 512, 1024, 1536, 2048, 3072, 4096, 6144, 8192]
    assert default_token_buckets(32, 2500) == [4, 8, 16, 24, 32, 64, 128, 256, 512, 1024, 1536, 2048, 2500]
    assert default_token_buckets(48, 5000) == [4, 8, 16, 24, 40, 48, 96, 192, 384, 768, 1536, 2304, 3072, 4608, 5000]
    assert default_token_buckets(48, 100) == [4, 8, 16, 24, 40, 48, 96, 100]
    assert default_token_buckets(4, 100) == [4, 8, 16, 32, 64, 100]
    assert default_token_buckets(1, 16) == [1, 2, 4, 8, 16]


def test_shape_plan_caps_the_largest_step_and_names_the_key():
    shapes = plan_shapes(num_rows=2, max_model_len=64, page_size=16, max_num_batched_tokens=8192)
    assert shapes.token_buckets[-1] == 128 and shapes.max_pages == 4  # 2 rows x 64 tokens at most
    assert shapes.bucket(3) == 4 and shapes.bucket(128) == 128
    with pytest.raises(ValueError, match="executor.token_buckets"):
        plan_shapes(2, 64, 16, 8192, token_buckets=[8, 64])
    with pytest.raises(ValueError, match="exceeds the largest token bucket"):
        shapes.bucket(129)


def test_pack_mixes_decodes_fresh_prefills_and_a_chunk_in_plan_order():
    shapes = plan_shapes(num_rows=4, max_model_len=32, page_size=4, max_num_batched_tokens=64, token_buckets=[4, 8, 16, 64])
    packer = BatchPacker(shapes, tiles=True)
    d1 = req("d1", [5, 6, 7], [8, 9], computed=4, new=1, slot=2)  # decodes token 9 at position 4
    d2 = req("d2", [1], [2], computed=1, new=1, slot=0)  # decodes token 2 at position 1
    p1 = req("p1", [11, 12, 13], [], computed=0, new=3, slot=1, temperature=0.5)  # fresh prefill
    c1 = req("c1", [20, 21, 22, 23, 24, 25], [], computed=4, new=2, slot=3)  # a chunk after 4 cached tokens
    plan = data_plan(num_slots=4, decodes=[d1, d2], prefills=[p1, c1], page_size=4,
                    page_tables={"d1": [3, 9], "d2": [4], "p1": [5], "c1": [6, 7]})  # fmt: skip
    b = packer.pack(plan)
    assert b.tokens.shape == (8,)  # 7 tokens -> bucket 8
    assert b.tokens.tolist() == [9, 2, 11, 12, 13, 24, 25, 0]
    assert b.positions.tolist() == [4, 1, 0, 1, 2, 4, 5, 0]
    assert b.token_pos.tolist() == [4, 1, 0, 1, 2, 4, 5, -1]
    assert b.token_row.tolist() == [0, 1, 2, 2, 2, 3, 3, 0]
    assert b.query_start.tolist() == [0, 1, 2, 5, 7]
    assert b.kv_lens.tolist() == [5, 2, 3, 6]
    assert b.logits_idx.tolist() == [0, 1, 4, 6]
    # page * 4 + offset: d1 pos 4 -> page 9 off 0; d2 pos 1 -> page 4 off 1; p1 -> page 5; c1 pos 4, 5 -> page 7
    assert b.write_idx.tolist() == [36, 17, 20, 21, 22, 28, 29, 0]
    assert b.page_table[:, :2].tolist() == [[3, 9], [4, 0], [5, 0], [6, 7]]
    temperature, top_k, top_p, seed, position = b.sampling
    assert temperature.tolist() == [0.0, 0.0, 0.5, 0.0] and seed.tolist() == [7, 7, 7, 7]
    assert position.tolist() == [5, 2, 3, 6]  # the index of the token each row generates
    assert (b.num_rows_used, b.num_tokens_used) == (4, 7)


def test_a_token_still_on_the_device_is_fed_from_the_previous_steps_row():
    shapes = plan_shapes(num_rows=4, max_model_len=32, page_size=4, max_num_batched_tokens=64, token_buckets=[4, 8, 16, 64])
    packer = BatchPacker(shapes, tiles=False)
    # d1 and d2 yielded a token in the step still running (rows 2 and 0 there); d3's is on the host
    d1 = req("d1", [5, 6, 7], [8, 9], computed=5, new=1, slot=2)
    d2 = req("d2", [1], [], computed=1, new=1, slot=0)
    d3 = req("d3", [4, 4], [3], computed=2, new=1, slot=1)
    p1 = req("p1", [11, 12, 13], [], computed=0, new=3, slot=3)
    packer.prev_rows = {"d2": 0, "d1": 2}
    plan = data_plan(num_slots=4, decodes=[d1, d2, d3], prefills=[p1], page_size=4,
                    page_tables={"d1": [3, 9], "d2": [4], "d3": [5], "p1": [6]})  # fmt: skip
    b = packer.pack(plan)
    assert b.tokens.tolist() == [0, 0, 3, 11, 12, 13, 0, 0]
    assert b.feed.tolist() == [2, 0, -1, -1, -1, -1, -1, -1]
    assert b.positions.tolist()[:6] == [5, 1, 2, 0, 1, 2]
    assert packer.empty(4).feed.tolist() == [-1] * 4
    # a token neither on the host nor in the step launched last, or a prefill past the known tokens
    packer.prev_rows = {"d1": 2}
    with pytest.raises(RuntimeError, match="request d2's last token is not on the host"):
        packer.pack(plan)
    # a plan without the ids of its new tokens (made for the simulator) names the request
    blind = ScheduledRequest("c", 0, 0, 3, False, page_table=(4,), sampling=SamplingParams())
    with pytest.raises(ValueError, match="request c has no token ids for its 3 new tokens"):
        packer.pack(Schedule(num_slots=4, scheduled=[blind], page_size=4))


def test_pack_pads_idle_rows_and_refreshes_a_slot_when_its_pages_grow():
    shapes = plan_shapes(num_rows=3, max_model_len=16, page_size=2, max_num_batched_tokens=16, token_buckets=[2, 16])
    packer = BatchPacker(shapes, tiles=False)
    r = req("r", [1, 2], [3], computed=2, new=1, slot=1)
    b = packer.pack(data_plan(num_slots=3, decodes=[r], page_tables={"r": [4, 5]}, page_size=2))
    assert b.tokens.tolist() == [3, 0] and b.query_start.tolist() == [0, 1, 1, 1] and b.kv_lens.tolist() == [3, 0, 0]
    assert b.write_idx.tolist() == [10, 0] and b.tiles is None
    r.output_token_ids.append(4)
    r.num_computed = 3
    b = packer.pack(data_plan(num_slots=3, decodes=[r], page_tables={"r": [4, 5]}, page_size=2))
    assert b.write_idx.tolist() == [11, 0]
    r.output_token_ids.append(5)
    r.num_computed = 4
    b = packer.pack(data_plan(num_slots=3, decodes=[r], page_tables={"r": [4, 5, 8]}, page_size=2))
    assert b.page_table[0, :3].tolist() == [4, 5, 8] and b.write_idx.tolist() == [16, 0]


def test_sampling_knobs_follow_each_slots_request_across_steps():
    # steady steps reuse the last step's knobs; a new request in a slot, or rows in another
    # order, must show at once, and an earlier batch's arrays never change
    shapes = plan_shapes(num_rows=3, max_model_len=16, page_size=2, max_num_batched_tokens=16, token_buckets=[4, 16])
    packer = BatchPacker(shapes, tiles=True)
    a = req("a", [1, 2], [3], computed=2, new=1, slot=0)
    b = req("b", [4, 5], [6], computed=2, new=1, slot=2, temperature=0.25)
    tables = {"a": [1, 2], "b": [3, 4], "c": [5, 6]}

    def knobs(reqs):
        batch = packer.pack(data_plan(num_slots=3, decodes=reqs, page_tables=tables, page_size=2))
        return batch.sampling[0].tolist(), batch.sampling[3].tolist(), batch

    first_t, first_seed, first = knobs([a, b])
    assert first_t == [0.0, 0.25, 0.0] and first_seed == [7, 7, 0]
    assert knobs([a, b])[0] == [0.0, 0.25, 0.0]
    assert knobs([b, a])[0] == [0.25, 0.0, 0.0]  # row order follows the plan
    c = req("c", [7], [8], computed=1, new=1, slot=0, temperature=0.75)  # a new request in a's slot
    c.sampling.seed = 9
    assert knobs([c, b])[:2] == ([0.75, 0.25, 0.0], [9, 7, 0])
    assert first.sampling[0].tolist() == first_t and first.sampling[3].tolist() == first_seed


# The hand-counted step of the tile tests: row 0 one decode token at position 1, row 1 three new
# tokens at positions 1..3, row 2 one decode token at position 4; a bucket of 6 tokens.
HAND_QUERY_START = np.array([0, 1, 4, 5], np.int32)
HAND_KV_LENS = np.array([2, 4, 5], np.int32)


def test_tiles_by_hand():
    # page_size 2, block 2, over 3 slots. Row 0's decode reads 1 page. Row 1's tokens form groups
    # [1, 2] (last position 2) and [3] (last position 3): 2 pages each. Row 2's decode reads 3 pages.
    query_start, kv_lens = HAND_QUERY_START, HAND_KV_LENS
    cap = tile_capacity(6, 3, 2, (1, 2))
    # single: 3 rows at most, chunks of 1; block: 3 rows of >= 2 tokens plus 3 full blocks, chunks of 2
    assert cap == ((3, 1), (6, 2))
    single, block = build_tiles(query_start, kv_lens, 6, 2, 2, cap)
    q, row, chunk_pages, num_chunks = single
    # longest first: row 2's token 4 (3 pages), then row 0's token 0 (1 page); the unused slot -> row 6
    assert q.tolist() == [[4], [0], [6]] and row[:2].tolist() == [2, 0]
    assert chunk_pages.tolist() == [3, 1, 0] and int(num_chunks) == 2
    q, row, chunk_pages, num_chunks = block
    assert q.tolist() == [[1, 2], [3, 6], [6, 6], [6, 6], [6, 6], [6, 6]] and row[:2].tolist() == [1, 1]
    assert chunk_pages.tolist() == [2, 0, 0] and int(num_chunks) == 1
    # in a bucket of 6 tokens a group holds at most 6: blocks of 64 shrink to 6 query slots
    cap = tile_capacity(6, 3, 64, (1, 2))
    assert cap == ((3, 1), (4, 2))  # block bound: min(6 // 2, 3) rows + 6 // 6 full blocks
    _, block = build_tiles(query_start, kv_lens, 6, 2, 64, cap)
    assert block[0][:1].tolist() == [[1, 2, 3, 6, 6, 6]] and int(block[3]) == 1
    # chunks shrink to the capacity: 2 tokens over 1 slot hold 1 single group, and the block
    # bound is min(2 // 2, 1) rows + 2 // 2 full blocks = 2
    assert tile_capacity(2, 1, 2, (4, 4)) == ((1, 1), (2, 2))
    # over 3 slots they are a group each (token groups), chunks shrunk to 2; no block list
    assert tile_capacity(2, 3, 2, (4, 4)) == ((2, 2), (0, 1))


def test_token_groups_by_hand():
    # the hand step over 6 slots: the 6-token step lists every token as a single group reading its
    # row's pages up to its own position, and has no block list. Positions: token 0 -> 1 (1 page);
    # tokens 1, 2, 3 -> 1, 2, 3 (1, 2, 2 pages); token 4 -> 4 (3 pages)
    query_start, kv_lens = HAND_QUERY_START, HAND_KV_LENS
    cap = tile_capacity(6, 6, 2, (4, 2))
    assert cap == ((8, 4), (0, 1))
    single, block = build_tiles(query_start, kv_lens, 6, 2, 2, cap)
    q, row, chunk_pages, num_chunks = single
    assert q[:, 0].tolist() == [4, 2, 3, 0, 1, 6, 6, 6] and row[:5].tolist() == [2, 1, 1, 0, 1]
    assert chunk_pages.tolist() == [3, 1] and int(num_chunks) == 2
    q, row, chunk_pages, num_chunks = block
    assert q.shape == (0, 2) and row.shape == (0,) and chunk_pages.shape == (0,) and int(num_chunks) == 0
    assert count_steps([(1, 1), (3, 1), (1, 4)], 2, 6, 6) == (1, 2, 0, 0)  # one chunk of 32: ceil(3 / 2) steps


def test_count_steps_by_hand():
    knobs = (tiles.BLOCK_Q, tiles.CHUNK_SINGLE, tiles.CHUNK_BLOCK, tiles.PAGES_SINGLE, tiles.PAGES_BLOCK)
    assert knobs == (64, 32, 8, 2, 4)  # the hand counts below assume these
    # page_size 4: a decode at position 4 reads 2 pages: one chunk, one step of 2 pages
    assert count_steps([(1, 4)], 4, 32, 1) == (1, 1, 0, 0)
    # a 100-token prefill: groups of 64 and 36 tokens ending at positions 63 and 99 read 16 and 25
    # pages; one chunk, run for its longest group: ceil(25 / 4) = 7 steps
    assert count_steps([(100, 0)], 4, 4096, 1) == (0, 0, 1, 7)
    # four of them: 8 groups; in a bucket of 4096 one chunk of 8 (7 steps), in 512 chunks of 1
    # (4 x 7 + 4 x 4 steps)
    assert count_steps([(100, 0)] * 4, 4, 4096, 4) == (0, 0, 1, 7)
    assert count_steps([(100, 0)] * 4, 4, 512, 4) == (0, 0, 8, 44)
    # 33 decodes at position 20 (6 pages each): chunks of 32 and 1, 3 steps each
    assert count_steps([(1, 20)] * 33, 4, 64, 33) == (2, 6, 0, 0)


def test_count_steps_matches_the_packed_lists():
    rng = np.random.default_rng(5)
    for _ in range(30):
        num_rows = int(rng.integers(1, 40))
        rows = [(int(rng.choice([1, 1, rng.integers(2, 150)])), int(rng.integers(0, 300))) for _ in range(num_rows)]
        n = np.array([r[0] for r in rows], np.int32)
        query_start = np.concatenate([[0], np.cumsum(n)]).astype(np.int32)
        kv_lens = np.array([ctx + k for k, ctx in rows], np.int32)
        bucket = int(query_start[-1]) + int(rng.choice([3, 2000]))  # small and large block chunks
        # a slot array of just these rows, or one no smaller than the step (a group per token)
        num_slots = int(rng.choice([len(rows), bucket]))
        cap = tile_capacity(bucket, num_slots, tiles.BLOCK_Q, (tiles.CHUNK_SINGLE, tiles.block_chunk(bucket)))
        single, block = build_tiles(query_start, kv_lens, bucket, 4, tiles.BLOCK_Q, cap)
        packed = []
        for (_, _, chunk_pages, num), step in ((single, tiles.PAGES_SINGLE), (block, tiles.PAGES_BLOCK)):
            packed += [int(num), int(sum(-(-int(p) // step) for p in chunk_pages[:num]))]
        assert count_steps(rows, 4, bucket, num_slots) == tuple(packed), rows


def test_packing_imports_no_jax():
    import subprocess

    code = "import sys, cbjax.runtime.batch, cbjax.layout.shapes, cbjax.core.plan; print('jax' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


def test_a_top_k_past_int32_packs_as_a_whole_vocabulary():
    from cbjax.runtime.batch import SamplingArrays

    arrays = SamplingArrays(2)
    arrays.set(0, SamplingParams(temperature=1.0, top_k=3_000_000_000))
    arrays.set(1, SamplingParams(temperature=1.0, top_k=7))
    assert arrays.top_k.tolist() == [2**31 - 1, 7]
