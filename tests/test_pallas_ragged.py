"""Pallas ragged paged attention (interpret mode) vs the jnp reference and the float64 oracle."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cbjax.kernels.metadata import AttentionMetadata
from cbjax.kernels.pallas_ragged import _work_items, ragged_paged_attention
from cbjax.kernels.reference import ragged_attention_reference
from ragged_cases import CASES, make_case, oracle

# f32 differs from the oracle only by summation order. bf16: inputs are bf16 everywhere,
# the kernel feeds bf16 softmax weights to the PV matmul and rounds the output to bf16.
TOLERANCE = {jnp.float32: 1e-5, jnp.bfloat16: 2e-2}

# Every case is padded to these shapes, so each (target, dtype, group) compiles once:
# interpret mode is all compile time at these sizes.
NUM_TOKENS = 32
NUM_ROWS = 6
MAX_PAGES = 5
NUM_PAGES = 20
BLOCK_Q = 4
PAGES_PER_BLOCK = 2

# Beyond the shared cases: idle rows between busy ones, and a row holding context that
# schedules no token this step (kv_len 6, 0 new), next to a one-token row.
EXTRA_CASES = {"idle_rows_between": [(5, 1), (0, 0), (9, 3), (6, 0), (1, 1)]}
ALL_CASES = {**CASES, **EXTRA_CASES}

_reference = jax.jit(ragged_attention_reference, static_argnames="scale")
_FIELDS = ("page_table", "query_start", "kv_lens", "token_row", "token_pos")


def _inputs(rows, *, group, dtype, seed=0, num_kv_heads=2, **shape):
    """(q, k_pages, v_pages, md) on device and the numpy case, padded to the shared shapes.

    Pages past the case's own are NaN, like every page a row may not read. For bf16 the
    oracle sees the same bf16-rounded inputs as the kernel.
    """
    shape = dict(num_tokens=NUM_TOKENS, num_rows=NUM_ROWS, max_pages=MAX_PAGES, num_pages=NUM_PAGES) | shape
    num_pages = shape.pop("num_pages")
    case = make_case(rows, num_kv_heads=num_kv_heads, group=group, seed=seed, **shape)
    pad = num_pages - case["k_pages"].shape[1]
    assert pad >= 0
    widths = ((0, 0), (0, pad), (0, 0), (0, 0))
    pages = [np.pad(case[n], widths, constant_values=np.nan) for n in ("k_pages", "v_pages")]
    q, k_pages, v_pages = (jnp.asarray(x, dtype) for x in (case["q"], *pages))
    to_dtype = lambda x: np.asarray(jnp.asarray(x, dtype).astype(jnp.float32))  # noqa: E731
    case = case | dict(q=to_dtype(case["q"]), dense_k=[to_dtype(k) for k in case["dense_k"]],
                       dense_v=[to_dtype(v) for v in case["dense_v"]])  # fmt: skip
    md = AttentionMetadata(*(jnp.asarray(case[n]) for n in _FIELDS))
    return (q, k_pages, v_pages, md), case


def _assert_close(actual, expected, dtype):
    tol = TOLERANCE[dtype]
    np.testing.assert_allclose(np.asarray(actual, np.float32), np.asarray(expected, np.float32), atol=tol, rtol=tol)


def _check(actual, args, case, dtype, **kw):
    assert actual.shape == args[0].shape and actual.dtype == dtype
    out = np.asarray(actual, np.float32)
    assert not np.isnan(out).any()
    np.testing.assert_array_equal(out[case["num_real_tokens"] :], 0.0)  # padding tokens: exact zeros
    _assert_close(actual, _reference(*args, **kw), dtype)
    if not kw:
        _assert_close(actual, oracle(case), dtype)


# Each entry is one interpret-mode compile (~5-10 s), so the product is pruned: the gpu grid
# spec differs from the tpu one only in how metadata and tile rows arrive (group 1 is padded,
# group 4 is not), and bf16 changes only rounding, which the group does not touch.
_KERNEL_CASES = [
    ("tpu", jnp.float32, 1),
    ("tpu", jnp.float32, 2),
    ("tpu", jnp.float32, 4),
    ("tpu", jnp.bfloat16, 4),
    ("gpu", jnp.float32, 1),
    ("gpu", jnp.float32, 4),
]


@pytest.mark.parametrize(
    "target,dtype,group", _KERNEL_CASES, ids=[f"{t}-{jnp.dtype(d).name}-g{g}" for t, d, g in _KERNEL_CASES]
)
def test_kernel_matches_reference_and_oracle(target, dtype, group):
    """Every shared case (decode-only, prefill-only, mixed, a chunk continuing context, page
    boundaries) plus idle rows, with NaN in every page a row may not read and padding tokens."""
    fn = functools.partial(
        ragged_paged_attention, block_q=BLOCK_Q, pages_per_block=PAGES_PER_BLOCK, interpret=True, target=target
    )
    for seed, (name, rows) in enumerate(ALL_CASES.items()):
        args, case = _inputs(rows, group=group, dtype=dtype, seed=seed)
        try:
            _check(fn(*args), args, case, dtype)
        except AssertionError as e:
            raise AssertionError(f"case {name}") from e


@pytest.mark.parametrize("target", ["tpu", "gpu"])
def test_one_token_blocks_more_pages_per_block_and_scale(target):
    """block_q 1 (one item per token; gpu pads the tile to 16 rows), a page step wider than
    some rows' tables need, and an explicit scale."""
    args, case = _inputs(CASES["mixed"], group=2, dtype=jnp.float32, seed=7, num_tokens=16)
    out = ragged_paged_attention(*args, scale=0.5, block_q=1, pages_per_block=3, interpret=True, target=target)
    _check(out, args, case, jnp.float32, scale=0.5)


def test_work_items_hand_computed():
    """Rows with 1, 0, 6 and 1 new tokens at block_q 4: blocks (0,0), (2,0), (2,1), (3,0), then
    padding items whose block lies past their row's tokens."""
    query_start = jnp.array([0, 1, 1, 7, 8], jnp.int32)
    item_row, item_qblock, blocks_start = _work_items(query_start, 7, 4)
    np.testing.assert_array_equal(item_row, [0, 2, 2, 3, 3, 3, 3])
    np.testing.assert_array_equal(item_qblock, [0, 0, 1, 0, 1, 2, 3])
    np.testing.assert_array_equal(blocks_start, [0, 1, 1, 3])


def test_bad_input_raises():
    (q, k_pages, v_pages, md), _ = _inputs(CASES["mixed"], group=2, dtype=jnp.float32)
    fn = functools.partial(ragged_paged_attention, interpret=True)
    with pytest.raises(ValueError, match=r"ragged_paged_attention: q head_dim 8 != k_pages head_dim 16.*\(32, 4, 8\)"):
        fn(q[..., :8], k_pages, v_pages, md)
    with pytest.raises(ValueError, match="num_heads 3 is not a multiple of num_kv_heads 2"):
        fn(q[:, :3], k_pages, v_pages, md)
    with pytest.raises(ValueError, match=r"token_row and token_pos must be \[num_tokens=31\]"):
        fn(q[:31], k_pages, v_pages, md)
    with pytest.raises(ValueError, match="block_q must be a power of two >= 1, got 3"):
        fn(q, k_pages, v_pages, md, block_q=3)
    with pytest.raises(ValueError, match="pages_per_block must be >= 1, got 0"):
        fn(q, k_pages, v_pages, md, pages_per_block=0)
    with pytest.raises(ValueError, match="unknown target 'cuda'"):
        fn(q, k_pages, v_pages, md, target="cuda")
    with pytest.raises(ValueError, match=r"Triton needs page_size and head_dim to be powers of two >= 16.*page_size 4"):
        ragged_paged_attention(q, k_pages, v_pages, md, target="gpu")


# Shapes a real model uses: page_size and head_dim satisfy Triton's 16-element minimum.
_REAL_ROWS = [(40, 1), (17, 1), (64, 16), (33, 9), (0, 0)]
_REAL = dict(head_dim=128, page_size=16, num_tokens=32, num_rows=6, max_pages=4, num_pages=16)


@pytest.mark.parametrize("target,platform", [("gpu", "cuda"), ("tpu", "tpu")])
def test_kernel_lowers_for_accelerators(target, platform):
    """Lower for a device this machine may not have: catches Triton / Mosaic lowering errors on CPU.

    Lowering stops short of the backend compiler (Triton to PTX, Mosaic layout passes).
    """
    args, _ = _inputs(_REAL_ROWS, group=4, dtype=jnp.bfloat16, **_REAL)
    specs = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), args)
    fn = jax.jit(functools.partial(ragged_paged_attention, block_q=8, target=target))
    checks = [jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")]
    exported = jax.export.export(fn, platforms=[platform], disabled_checks=checks)(*specs)
    mlir = exported.mlir_module()
    assert ("__gpu$xla.gpu.triton" if target == "gpu" else "tpu_custom_call") in mlir


@pytest.mark.skipif(jax.default_backend() == "cpu", reason="compiled Pallas needs a GPU or TPU")
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("group", [1, 4])
def test_compiled_kernel_matches_reference(dtype, group):
    args, case = _inputs(_REAL_ROWS, group=group, dtype=dtype, seed=group, **_REAL)
    _check(ragged_paged_attention(*args), args, case, dtype)


def _pallas_call_eqn(jaxpr):
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "pallas_call":
            return eqn
        for param in eqn.params.values():
            inner = getattr(param, "jaxpr", param)
            if hasattr(inner, "eqns") and (found := _pallas_call_eqn(inner)):
                return found
    return None


def test_tpu_kernel_streams_pages_from_hbm():
    """The tpu kernel leaves the page arrays in HBM (`any`) and holds only a double buffer of
    pages_per_block pages in VMEM, whatever the cache size."""
    args, _ = _inputs(_REAL_ROWS, group=4, dtype=jnp.bfloat16, **_REAL)
    fn = functools.partial(ragged_paged_attention, block_q=8, pages_per_block=2, target="tpu")
    eqn = _pallas_call_eqn(jax.make_jaxpr(fn)(*args).jaxpr)
    refs = [(str(v.aval.memory_space), v.aval.shape) for v in eqn.params["jaxpr"].invars]
    pages = (1, *args[1].shape)  # [num_layers, num_kv_heads, num_pages, page_size, head_dim]: the whole cache
    assert refs.count(("any", pages)) == 2  # k and v pages
    assert refs.count(("vmem", (2, 2, *pages[3:]))) == 2  # their double buffers
    assert all(shape != pages for space, shape in refs if space != "any")


@pytest.mark.parametrize("target", ["tpu", "gpu"])
def test_layer_of_a_stacked_cache_is_read_in_place_and_equals_that_layer_alone(target):
    """With `layer=`, the kernel takes the whole [num_layers, ...] cache and reads that layer's
    pages: the same output as the layer's pages alone, and the program slices no layer out (the
    pallas_call's page operands are the whole cache)."""
    args, case = _inputs(CASES["mixed"], group=2, dtype=jnp.float32, seed=3, num_tokens=16)
    q, k, v, md = args
    noise = np.random.default_rng(5).standard_normal((3, *k.shape)).astype(np.float32)
    k_all, v_all = jnp.asarray(noise).at[1].set(k), jnp.asarray(-noise).at[1].set(v)  # other layers: other values
    fn = functools.partial(ragged_paged_attention, block_q=BLOCK_Q, pages_per_block=PAGES_PER_BLOCK, interpret=True,
                           target=target)  # fmt: skip
    alone = np.asarray(fn(q, k, v, md))
    np.testing.assert_array_equal(np.asarray(fn(q, k_all, v_all, md, layer=jnp.int32(1))), alone)
    assert not np.allclose(np.asarray(fn(q, k_all, v_all, md, layer=jnp.int32(0))), alone)
    jaxpr = jax.make_jaxpr(lambda k, v, layer: fn(q, k, v, md, layer=layer))(k_all, v_all, jnp.int32(1)).jaxpr
    eqn = _pallas_call_eqn(jaxpr)
    shapes = [tuple(v.aval.shape) for v in eqn.params["jaxpr"].invars]
    whole = k_all.shape if target == "tpu" else (k_all.shape[0] * k_all.shape[1] * k_all.shape[2], *k_all.shape[3:])
    assert shapes.count(whole) == 2
    assert not any(e.primitive.name in ("dynamic_slice", "slice", "gather") and tuple(e.outvars[0].aval.shape) == k.shape
                   for e in jaxpr.eqns)  # fmt: skip
