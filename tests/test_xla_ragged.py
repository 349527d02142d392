"""The XLA ragged attention and the jnp reference against the float64 oracle, per layer or
gathered from the whole cache."""

from __future__ import annotations

import dataclasses
import functools

import jax.numpy as jnp
import numpy as np
import pytest

from ragged_cases import CASES, make_case, oracle
from cbjax.kernels.metadata import AttentionMetadata
from cbjax.kernels.reference import ragged_attention_reference
from cbjax.kernels.xla_ragged import RaggedWork, Tiles, ragged_attention_xla
from cbjax.layout.tiles import build_tiles, tile_capacity

FIELDS = ("page_table", "query_start", "kv_lens", "token_row", "token_pos")


def metadata(case, block, chunk):
    num_tokens, num_rows = case["q"].shape[0], case["kv_lens"].shape[0]
    cap = tile_capacity(num_tokens, num_rows, block, (chunk, chunk))
    page_size = case["k_pages"].shape[2]
    single, multi = build_tiles(case["query_start"], case["kv_lens"], num_tokens, page_size, block, cap)
    work = RaggedWork(Tiles(*map(jnp.asarray, single)), Tiles(*map(jnp.asarray, multi)))
    return AttentionMetadata(*(jnp.asarray(case[f]) for f in FIELDS), work=work)


@pytest.mark.parametrize("num_kv_heads, group", [(2, 1), (2, 2), (1, 4)])
@pytest.mark.parametrize("whole_cache", [False, True])
def test_matches_the_oracle_on_every_case(num_kv_heads, group, whole_cache, attention=None):
    """`attention`: the backend under test (the XLA one, pages_single 1 and pages_block 3: the
    last step of a long group reads past its page-table row); the native tests pass theirs."""
    attention = attention or functools.partial(ragged_attention_xla, pages_single=1, pages_block=3)
    for name, rows in CASES.items():
        # two idle rows and three padding tokens; blocks of 4 cut the longer rows
        case = make_case(rows, num_kv_heads=num_kv_heads, group=group, num_tokens=sum(n for _, n in rows) + 3,
                         num_rows=len(rows) + 2, seed=len(name))  # fmt: skip
        # chunks of 2: several per list (the outer loop); chunks of 64: one per list (no outer loop)
        md = metadata(case, block=4, chunk=64 if whole_cache else 2)
        q, k, v = (jnp.asarray(case[n]) for n in ("q", "k_pages", "v_pages"))
        kw = {}
        if whole_cache:  # the layer under test is 1; layer 0 holds other values
            k, v = jnp.stack([k + 3.0, k]), jnp.stack([v - 3.0, v])
            kw = dict(layer=jnp.int32(1))
        want = oracle(case)
        got = np.asarray(attention(q, k, v, md, **kw))
        ref = np.asarray(ragged_attention_reference(q, k, v, md, **kw))
        np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5, err_msg=name)
        np.testing.assert_allclose(ref, want, atol=1e-5, rtol=1e-5, err_msg=name)
        assert not np.abs(got[case["num_real_tokens"] :]).any(), f"{name}: padding tokens must give zeros"


def test_token_groups_match_the_oracle(attention=None):
    # a slot array no smaller than the step: every token is its own single group, no block list
    attention = attention or functools.partial(ragged_attention_xla, pages_single=3, pages_block=3)
    for name, rows in CASES.items():
        num_tokens = sum(n for _, n in rows) + 3
        case = make_case(rows, num_kv_heads=2, group=2, num_tokens=num_tokens, num_rows=num_tokens, seed=len(name))
        md = metadata(case, block=4, chunk=2)
        assert md.work.block.q_idx.shape[0] == 0, name
        q, k, v = (jnp.asarray(case[n]) for n in ("q", "k_pages", "v_pages"))
        got = np.asarray(attention(q, k, v, md))
        np.testing.assert_allclose(got, oracle(case), atol=1e-5, rtol=1e-5, err_msg=name)
        assert not np.abs(got[case["num_real_tokens"] :]).any(), f"{name}: padding tokens must give zeros"


def test_bad_shapes_and_missing_tiles_name_the_problem():
    case = make_case(CASES["mixed"], num_kv_heads=2, group=2)
    md = metadata(case, block=4, chunk=2)
    q, k, v = (jnp.asarray(case[n]) for n in ("q", "k_pages", "v_pages"))
    with pytest.raises(ValueError, match="whole cache"):
        ragged_attention_xla(q, k, v, md, layer=jnp.int32(0))
    with pytest.raises(ValueError, match="q head_dim"):
        ragged_attention_xla(q[..., :8], k, v, md)
    bare = AttentionMetadata(*(jnp.asarray(case[f]) for f in FIELDS))
    with pytest.raises(ValueError, match="RaggedWork"):
        ragged_attention_xla(q, k, v, bare)
    single = md.work.single
    odd = Tiles(single.q_idx[:3], single.row[:3], single.chunk_pages[:2], single.num_chunks)
    uneven = dataclasses.replace(md, work=RaggedWork(odd, md.work.block))
    with pytest.raises(ValueError, match="single capacity 3 is not a multiple of its 2 chunks"):
        ragged_attention_xla(q, k, v, uneven)
