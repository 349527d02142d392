"""Paged attention: Pallas kernel (interpret mode) vs reference vs dense numpy attention."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cbjax.kernels.paged_attention import (
    attention_op,
    paged_attention,
    paged_attention_ragged,
    paged_attention_reference,
    resolve_attention,
)

# Kernel vs reference, and reference vs float64 numpy. f32 differs only by summation
# order. bf16: inputs are bf16 on both sides, but the kernel feeds bf16 softmax weights
# to the PV matmul and both round the output to bf16 (8-bit mantissa, ~4e-3 relative).
TOLERANCE = {jnp.float32: 1e-5, jnp.bfloat16: 2e-2}

PAGE_SIZE = 4
MAX_PAGES_PER_SEQ = 6
NUM_PAGES = 40
HEAD_DIM = 16
NUM_KV_HEADS = 2
# Eager jnp compiles every op for every new shape; one jitted program is much cheaper.
_reference = jax.jit(paged_attention_reference, static_argnames="scale")

# Length 0, one token, inside the first page, exact page multiples, a partial page, full table.
LENGTHS = (0, 1, 3, 8, 13, 24)


def _make_case(seed, dtype, group, *, num_kv_heads=NUM_KV_HEADS, head_dim=HEAD_DIM, page_size=PAGE_SIZE,
               max_pages=MAX_PAGES_PER_SEQ, num_pages=NUM_PAGES, lengths=LENGTHS):
    """Random paged inputs. Every cache entry a slot may not read, page 0 included, is NaN."""
    rng = np.random.default_rng(seed)
    num_slots = len(lengths)
    max_len = max_pages * page_size
    q = rng.normal(size=(num_slots, num_kv_heads * group, head_dim))
    dense_k = rng.normal(size=(num_slots, max_len, num_kv_heads, head_dim))
    dense_v = rng.normal(size=(num_slots, max_len, num_kv_heads, head_dim))
    # Round once so every implementation sees the same values.
    q, dense_k, dense_v = (np.asarray(jnp.asarray(x, dtype).astype(jnp.float32)) for x in (q, dense_k, dense_v))

    k_pages = np.full((num_kv_heads, num_pages, page_size, head_dim), np.nan, np.float32)
    v_pages = np.full_like(k_pages, np.nan)
    # Garbage, out-of-range page ids past each length: they must never be read.
    page_table = rng.integers(-5, 10**6, size=(num_slots, max_pages)).astype(np.int32)
    free_pages = iter(rng.permutation(np.arange(1, num_pages)))
    for slot, length in enumerate(lengths):
        for page_pos in range(-(-length // page_size)):
            page_idx = next(free_pages)
            page_table[slot, page_pos] = page_idx
            for offset in range(page_size):
                t = page_pos * page_size + offset
                if t < length:
                    k_pages[:, page_idx, offset] = dense_k[slot, t]
                    v_pages[:, page_idx, offset] = dense_v[slot, t]
    args = (
        jnp.asarray(q, dtype),
        jnp.asarray(k_pages, dtype),
        jnp.asarray(v_pages, dtype),
        jnp.asarray(page_table),
        jnp.asarray(lengths, jnp.int32),
    )
    return args, (q, dense_k, dense_v)


def _dense_numpy(q, dense_k, dense_v, lengths, group):
    """Per-slot softmax attention in float64 over the first `length` tokens."""
    num_slots, num_heads, head_dim = q.shape
    out = np.zeros((num_slots, num_heads, head_dim))
    for slot, length in enumerate(lengths):
        for head in range(num_heads):
            k = dense_k[slot, :length, head // group].astype(np.float64)
            v = dense_v[slot, :length, head // group].astype(np.float64)
            if length == 0:
                continue
            scores = k @ q[slot, head].astype(np.float64) / np.sqrt(head_dim)
            p = np.exp(scores - scores.max())
            out[slot, head] = p @ v / p.sum()
    return out


def _assert_close(actual, expected, dtype):
    tol = TOLERANCE[dtype]
    np.testing.assert_allclose(np.asarray(actual, np.float32), np.asarray(expected, np.float32), atol=tol, rtol=tol)


# The gpu grid spec differs from the tpu one only in how page_table, lengths and q rows
# arrive, none of which depends on dtype, so it runs in f32 alone.
_KERNEL_CASES = [("tpu", jnp.float32), ("tpu", jnp.bfloat16), ("gpu", jnp.float32)]


@pytest.mark.parametrize("target,dtype", _KERNEL_CASES, ids=["tpu-f32", "tpu-bf16", "gpu-f32"])
@pytest.mark.parametrize("group", [1, 2, 4])
def test_kernel_matches_reference(target, dtype, group):
    args, _ = _make_case(group, dtype, group)
    expected = _reference(*args)
    actual = paged_attention(*args, pages_per_block=4, interpret=True, target=target)
    assert actual.shape == expected.shape and actual.dtype == dtype
    assert not np.isnan(np.asarray(actual, np.float32)).any()
    np.testing.assert_array_equal(np.asarray(actual[0], np.float32), 0.0)  # length 0: exact zeros
    _assert_close(actual, expected, dtype)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("group", [1, 2, 4])
def test_reference_matches_dense_numpy(dtype, group):
    args, (q, dense_k, dense_v) = _make_case(10 + group, dtype, group)
    actual = _reference(*args)
    assert not np.isnan(np.asarray(actual, np.float32)).any()
    np.testing.assert_array_equal(np.asarray(actual[0], np.float32), 0.0)
    _assert_close(actual, _dense_numpy(q, dense_k, dense_v, LENGTHS, group), dtype)


# Pages held by LENGTHS at PAGE_SIZE: the fewest entries ragged attention may be given.
_HELD = sum(-(-n // PAGE_SIZE) for n in LENGTHS)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("group", [1, 2, 4])
def test_ragged_matches_reference_and_dense_numpy(dtype, group):
    """Exactly the held pages, padding entries, and the whole table give the same answer."""
    args, (q, dense_k, dense_v) = _make_case(50 + group, dtype, group)
    expected = _reference(*args)
    dense = _dense_numpy(q, dense_k, dense_v, LENGTHS, group)
    for num_entries in (_HELD, _HELD + 5, None):
        actual = jax.jit(functools.partial(paged_attention_ragged, num_entries=num_entries))(*args)
        assert actual.shape == expected.shape and actual.dtype == dtype
        assert not np.isnan(np.asarray(actual, np.float32)).any()
        np.testing.assert_array_equal(np.asarray(actual[0], np.float32), 0.0)  # length 0: exact zeros
        _assert_close(actual, expected, dtype)
        _assert_close(actual, dense, dtype)


def test_ragged_reads_only_the_entries_it_is_given():
    """One entry short of the held pages drops the last slot's last page: the contract is the
    caller's to keep, and the test shows the entry count is what bounds the work."""
    args, _ = _make_case(60, jnp.float32, 2)
    short = paged_attention_ragged(*args, num_entries=_HELD - 1)
    expected = _reference(*args)
    _assert_close(short[:-1], expected[:-1], jnp.float32)
    assert not np.allclose(np.asarray(short[-1]), np.asarray(expected[-1]), atol=1e-3)


@pytest.mark.parametrize("pages_per_block", [1, 6])
def test_pages_per_block_and_scale(pages_per_block):
    args, _ = _make_case(20 + pages_per_block, jnp.float32, 2)
    expected = _reference(*args, scale=0.5)
    actual = paged_attention(*args, scale=0.5, pages_per_block=pages_per_block, interpret=True)
    _assert_close(actual, expected, jnp.float32)


def test_attention_op_dispatch():
    args, _ = _make_case(30, jnp.float32, 2)
    expected = _reference(*args)
    if jax.default_backend() == "cpu":
        assert resolve_attention("auto") == "ragged"
        assert attention_op("auto").func is paged_attention_ragged
    assert attention_op("reference") is paged_attention_reference
    _assert_close(attention_op("pallas")(*args), expected, jnp.float32)
    _assert_close(attention_op("ragged", num_entries=14)(*args), expected, jnp.float32)
    with pytest.raises(ValueError, match="unknown value 'flash'"):
        attention_op("flash")
    if jax.default_backend() == "cpu":
        with pytest.raises(ValueError, match="triton needs a GPU"):
            attention_op("triton")


def test_bad_shapes_raise():
    (q, k_pages, v_pages, page_table, lengths), _ = _make_case(40, jnp.float32, 2)
    for fn in (paged_attention_reference, paged_attention_ragged, functools.partial(paged_attention, interpret=True)):
        with pytest.raises(ValueError, match=r"page_table has 5 rows, q has 6 slots.*page_table \(5, 6\)"):
            fn(q, k_pages, v_pages, page_table[:5], lengths)
        with pytest.raises(ValueError, match="q head_dim 8 != k_pages head_dim 16"):
            fn(q[..., :8], k_pages, v_pages, page_table, lengths)
        with pytest.raises(ValueError, match="num_heads 3 is not a multiple of num_kv_heads 2"):
            fn(q[:, :3], k_pages, v_pages, page_table, lengths)
        with pytest.raises(ValueError, match="same shape"):
            fn(q, k_pages, v_pages[:, :10], page_table, lengths)
        with pytest.raises(ValueError, match=r"lengths must be \[num_slots\]"):
            fn(q, k_pages, v_pages, page_table, lengths[:2])
    with pytest.raises(ValueError, match="unknown target 'cuda'"):
        paged_attention(q, k_pages, v_pages, page_table, lengths, interpret=True, target="cuda")
    with pytest.raises(ValueError, match="Triton needs page_size and head_dim to be powers of two >= 16"):
        paged_attention(q, k_pages, v_pages, page_table, lengths, target="gpu")  # page_size 4


# Shapes a real model uses: page_size and head_dim satisfy Triton's 16-element minimum.
_REAL = dict(num_kv_heads=2, head_dim=128, page_size=16, max_pages=4, num_pages=24, lengths=(0, 1, 16, 37, 64))


@pytest.mark.parametrize("target,platform", [("gpu", "cuda"), ("tpu", "tpu")])
def test_kernel_lowers_for_accelerators(target, platform):
    """Lower for a device this machine may not have: catches Triton / Mosaic lowering errors on CPU.

    Lowering stops short of the backend compiler (Triton to PTX, Mosaic layout passes).
    """
    args, _ = _make_case(50, jnp.bfloat16, 4, **_REAL)
    specs = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in args]
    fn = jax.jit(functools.partial(paged_attention, target=target))
    checks = [jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")]
    exported = jax.export.export(fn, platforms=[platform], disabled_checks=checks)(*specs)
    assert "custom_call" in exported.mlir_module()


@pytest.mark.skipif(jax.default_backend() == "cpu", reason="compiled Pallas needs a GPU or TPU")
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("group", [1, 4])
def test_compiled_kernel_matches_reference(dtype, group):
    args, _ = _make_case(60 + group, dtype, group, **_REAL)
    expected = _reference(*args)
    actual = paged_attention(*args)
    assert not np.isnan(np.asarray(actual, np.float32)).any()
    np.testing.assert_array_equal(np.asarray(actual[0], np.float32), 0.0)
    _assert_close(actual, expected, dtype)
