"""The native attention backend and K/V write (`cbjax.kernels.native`) against the float64 oracle
and XLA's, and how the kernels are found, built and pruned."""

from __future__ import annotations

import os

import jax.numpy as jnp
import numpy as np
import pytest

from ragged_cases import CASES, make_case, oracle
import test_xla_ragged as xla_cases
from test_xla_ragged import metadata

native = pytest.importorskip("cbjax.kernels.native", reason="the native CPU kernels package is not installed")
from cbjax.kernels.native.attention import ragged_attention_native  # noqa: E402

pytestmark = pytest.mark.native


@pytest.mark.parametrize("num_kv_heads, group", [(2, 1), (2, 2), (1, 4)])
@pytest.mark.parametrize("whole_cache", [False, True])
def test_native_matches_the_oracle_on_every_case(num_kv_heads, group, whole_cache):
    xla_cases.test_matches_the_oracle_on_every_case(num_kv_heads, group, whole_cache, attention=ragged_attention_native)


def test_native_token_groups_match_the_oracle():
    xla_cases.test_token_groups_match_the_oracle(attention=ragged_attention_native)


@pytest.mark.parametrize("page_size", [8, 16])
@pytest.mark.parametrize("token_groups", [False, True])
def test_native_vectorized_pages_match_the_oracle(page_size, token_groups):
    # The native kernels' fixed-size page routines run when the page holds one or two vectors of
    # keys (8 or 16 lanes: AVX2 or AVX-512) and head_dim is whole vectors; pages of 8 and 16 with
    # head_dim 32 take them on either machine (and the scalar loops on the other size). With
    # token_groups every token is a single group (the decode routine at every position, pages
    # crossed, a page's last key, unwritten NaN slots after it); else the block list runs too.
    rows = [(40, 20), (33, 1), (17, 17), (16, 9), (5, 5)]  # prefills crossing pages, a decode, boundaries
    num_tokens = sum(n for _, n in rows) + 3
    for num_kv_heads, group in ((2, 2), (1, 4)):
        case = make_case(rows, num_kv_heads=num_kv_heads, group=group, head_dim=32, page_size=page_size,
                         num_tokens=num_tokens, num_rows=num_tokens if token_groups else len(rows) + 1,
                         seed=page_size + group)  # fmt: skip
        md = metadata(case, block=8, chunk=2)
        assert (md.work.block.q_idx.shape[0] == 0) == token_groups
        q, k, v = (jnp.asarray(case[n]) for n in ("q", "k_pages", "v_pages"))
        got = np.asarray(ragged_attention_native(q, k, v, md))
        np.testing.assert_allclose(got, oracle(case), atol=1e-5, rtol=1e-5, err_msg=f"group {group}")
        assert not np.abs(got[case["num_real_tokens"] :]).any()


def test_native_block_list_writes_its_tokens_into_base_and_nothing_else():
    # The block list writes in place into the single list's token-order output: its real tokens'
    # rows get their attention, every other row (single-group tokens, padding) keeps base's.
    case = make_case(CASES["mixed"], num_kv_heads=2, group=2, num_tokens=sum(n for _, n in CASES["mixed"]) + 3,
                     num_rows=len(CASES["mixed"]) + 2, seed=5)  # fmt: skip
    md = metadata(case, block=4, chunk=2)
    block = md.work.block
    num_tokens, num_heads, head_dim = case["q"].shape
    num_kv_heads, num_pages, page_size = case["k_pages"].shape[:3]
    group = num_heads // num_kv_heads
    q = jnp.asarray(case["q"]).reshape(num_tokens, num_kv_heads, group, head_dim)  # token order, unscaled
    pos_ext = jnp.concatenate([md.token_pos, jnp.full((1,), -1, jnp.int32)])
    k_flat = jnp.asarray(case["k_pages"]).reshape(-1, page_size * head_dim)
    v_flat = jnp.asarray(case["v_pages"]).reshape(-1, page_size * head_dim)
    page_base = jnp.arange(num_kv_heads, dtype=jnp.int32) * num_pages
    base = jnp.full((num_tokens, num_kv_heads, group, head_dim), 7.0, jnp.float32)
    got = np.asarray(native.block_groups_into(base, q, pos_ext, block.q_idx, block.row, md.page_table, k_flat, v_flat,
                                              page_base, num_pages, 1 / np.sqrt(head_dim)))  # fmt: skip
    got = got.reshape(num_tokens, num_heads, head_dim)
    idx = np.asarray(block.q_idx).reshape(-1)
    mine = np.zeros(num_tokens, bool)
    mine[idx[(idx >= 0) & (idx < num_tokens)]] = True
    assert 0 < mine.sum() < case["num_real_tokens"]  # the block list holds some of the real tokens, not all
    np.testing.assert_allclose(got[mine], oracle(case)[mine], atol=1e-5, rtol=1e-5)
    assert (got[~mine] == 7.0).all()
    with pytest.raises(ValueError, match=r"base has shape \(3, 2, 2, 16\), not q's \[tokens, kv_heads, group, head_dim\] = \(17, 2, 2, 16\)"):
        native.block_groups_into(base[:3], q, pos_ext, block.q_idx, block.row, md.page_table, k_flat, v_flat,
                                 page_base, num_pages, 1.0)  # fmt: skip


def test_native_kernel_builds_here_and_auto_picks_it_on_cpu():
    from cbjax.kernels.registry import resolve_attention

    assert native.ensure_registered() is None
    assert resolve_attention("auto", "cpu") == "native"
    assert resolve_attention("auto", "gpu") == "pallas"
    with pytest.raises(ValueError, match="executor.attention=native: it is the CPU kernel"):
        resolve_attention("native", "gpu")


def test_without_a_compiler_auto_falls_back_to_ragged_and_native_names_why(no_compiler, capsys):
    from cbjax.kernels.registry import resolve_attention

    assert resolve_attention("auto", "cpu") == "ragged"
    assert "no GCC C++ compiler found" in capsys.readouterr().err
    with pytest.raises(ValueError, match="executor.attention=native: .*no GCC C\\+\\+ compiler found"):
        resolve_attention("native", "cpu")


def test_a_build_prunes_stale_builds_and_half_written_ones(tmp_path):
    # days since each file was last loaded (its mtime): the current build and one loaded 10 days
    # ago stay, one of 40 days goes (past STALE_S, 30 days); half-written builds go after a day
    now = 1e9
    ages = {"cbjax_native_current.so": 40, "cbjax_native_recent.so": 10, "cbjax_native_old.so": 40,
            "tmpabc.so": 2, "tmpfresh.so": 0.5, "unrelated.so": 400}  # fmt: skip
    for name, days in ages.items():
        (tmp_path / name).write_bytes(b"")
        os.utime(tmp_path / name, (now - days * 86400, now - days * 86400))
    gone = native.prune(tmp_path, keep=tmp_path / "cbjax_native_current.so", now=now)
    assert sorted(p.name for p in gone) == ["cbjax_native_old.so", "tmpabc.so"]
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "cbjax_native_current.so", "cbjax_native_recent.so", "tmpfresh.so", "unrelated.so"
    ]  # fmt: skip


def test_native_write_kv_equals_write_layer_on_the_sliced_k_and_v():
    from cbjax.runtime.kv_cache import write_layer

    rng = np.random.default_rng(1)
    layers, kv_heads, pages, page_size, head_dim, group, tokens = 3, 2, 5, 4, 8, 2, 7
    shape = (layers, kv_heads, pages, page_size, head_dim)
    k_pages = jnp.asarray(rng.standard_normal(shape).astype(np.float32))
    v_pages = jnp.asarray(rng.standard_normal(shape).astype(np.float32))
    product = rng.standard_normal((tokens, kv_heads, group + 2, head_dim)).astype(np.float32)
    product[3:5] = 0.0  # padding tokens: the matmul's zero rows (XLA's scatter leaves the order of duplicates open)
    product = jnp.asarray(product)
    # slots across pages, two padding tokens on slot 0 (the null page), one from the end, one past it (dropped)
    write_idx = jnp.asarray([5, 6, 13, 0, 0, -1, pages * page_size + 3], jnp.int32)
    for layer in (0, 2):
        k_want = write_layer(k_pages, layer, write_idx, product[:, :, group])
        v_want = write_layer(v_pages, layer, write_idx, product[:, :, group + 1])
        k_got, v_got = native.write_kv(product, write_idx, jnp.int32(layer), k_pages, v_pages)
        np.testing.assert_array_equal(np.asarray(k_got), np.asarray(k_want), err_msg=f"k, layer {layer}")
        np.testing.assert_array_equal(np.asarray(v_got), np.asarray(v_want), err_msg=f"v, layer {layer}")
        assert not np.array_equal(np.asarray(k_got), np.asarray(k_pages))  # it wrote something
    with pytest.raises(ValueError, match=r"write_kv: qkv must be \[T, kv_heads, group \+ 2, head_dim\]"):
        native.write_kv(product[:, :, :2], write_idx, 0, k_pages, v_pages)


@pytest.mark.parametrize("num_kv_heads, group", [(2, 2), (1, 4)])
def test_native_reads_the_queries_in_place_in_the_fused_product(num_kv_heads, group):
    # Given the contract's qkv (the fused product [T, kv_heads, group + 2, head_dim]), the kernels
    # read each kv head's queries there (the first `group` on axis 2, then k and v): the same
    # result as from q, with both lists running (a mixed step: decodes, prefills, block groups).
    case = make_case(CASES["mixed"], num_kv_heads=num_kv_heads, group=group,
                     num_tokens=sum(n for _, n in CASES["mixed"]) + 3, num_rows=len(CASES["mixed"]) + 2, seed=11)  # fmt: skip
    md = metadata(case, block=4, chunk=2)
    assert md.work.single.q_idx.shape[0] and md.work.block.q_idx.shape[0]
    q, k, v = (jnp.asarray(case[n]) for n in ("q", "k_pages", "v_pages"))
    num_tokens, _, head_dim = q.shape
    rng = np.random.default_rng(0)
    kv_rows = jnp.asarray(rng.standard_normal((num_tokens, num_kv_heads, 2, head_dim)).astype(np.float32) * 100)
    product = jnp.concatenate([q.reshape(num_tokens, num_kv_heads, group, head_dim), kv_rows], axis=2)
    got = np.asarray(ragged_attention_native(q, k, v, md, qkv=product))
    np.testing.assert_array_equal(got, np.asarray(ragged_attention_native(q, k, v, md)))
    np.testing.assert_allclose(got, oracle(case), atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match=r"qkv \(.*\) is not the fused product"):
        ragged_attention_native(q, k, v, md, qkv=product[:, :, :group])
