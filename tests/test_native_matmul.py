"""The native few-row matmul (`executor.matmul=native`) against float64 numpy, and how it is chosen."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cbjax.app.choices import check_choices
from cbjax.config import ExecutorConfig, RunConfig
from cbjax.kernels.registry import resolve_matmul

native = pytest.importorskip("cbjax.kernels.native", reason="the native CPU kernels package is not installed")
pytestmark = pytest.mark.native

# (rows, k, n): one row to more than a row tile (6); n covering the wide column tiles (4 vectors),
# single vectors and a scalar remainder on AVX2 (8 lanes) and AVX-512 (16 lanes) alike (one
# row-major panel), and whole panels of 64 (2 and 8); two products large enough to be split
# over threads; and rows over three row blocks (48 rows at k 2048, the last block 4 rows).
SHAPES = [(1, 3, 5), (4, 64, 128), (7, 33, 80), (13, 16, 200), (32, 256, 517), (32, 96, 512), (100, 2048, 128)]


def _draw(rng, *shape):
    return rng.standard_normal(shape, dtype=np.float32)


@pytest.mark.parametrize("rows, k, n", SHAPES)
def test_layer_matmul_equals_float64_numpy_for_the_chosen_layer(rows, k, n):
    rng = np.random.default_rng(rows * 1000 + n)
    x, w = _draw(rng, rows, k), _draw(rng, 3, k, n)
    fn = jax.jit(native.layer_matmul)
    for layer in (0, 2):
        got = np.asarray(fn(jnp.asarray(x), jnp.asarray(native.to_panels(w)), jnp.int32(layer)))
        want = x.astype(np.float64) @ w[layer].astype(np.float64)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.sqrt(k), err_msg=f"layer {layer}")


def test_layer_index_is_clipped_and_several_axes_contract():
    rng = np.random.default_rng(0)
    # x [2, 5, 4, 3] contracts [4, 3] of w's layers; out [2, 64]: two panels
    x, w = _draw(rng, 2, 5, 4, 3), _draw(rng, 2, 4, 3, 2, 64)
    wp = jnp.asarray(native.to_panels(w, num_in=2))
    got = np.asarray(native.layer_matmul(jnp.asarray(x), wp, 9, num_in=2))
    want = np.tensordot(x.astype(np.float64), w[1].astype(np.float64), axes=2)  # layer 9 -> the last, 1
    assert got.shape == (2, 5, 2, 64)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    got = np.asarray(native.layer_matmul(jnp.asarray(x), wp, -4, num_in=2))
    np.testing.assert_allclose(got, np.tensordot(x.astype(np.float64), w[0].astype(np.float64), axes=2), rtol=1e-5, atol=1e-5)


def test_panel_order_by_hand_and_back():
    # a [2, 128] matrix: panel 0 is columns 0-63 of rows 0 and 1, then panel 1 is columns 64-127
    w = np.arange(2 * 128, dtype=np.float32).reshape(1, 2, 128)
    flat = native.to_panels(w).reshape(-1)
    assert native.to_panels(w).shape == (1, 2, 128)
    np.testing.assert_array_equal(flat[:64], np.arange(0, 64))  # row 0, columns 0-63
    np.testing.assert_array_equal(flat[64:128], np.arange(128, 192))  # row 1, columns 0-63
    np.testing.assert_array_equal(flat[128:192], np.arange(64, 128))  # row 0, columns 64-127
    np.testing.assert_array_equal(flat[192:], np.arange(192, 256))  # row 1, columns 64-127
    # n = 96 is no multiple of 64: the matrix stays row-major
    odd = np.arange(3 * 96, dtype=np.float32).reshape(1, 3, 96)
    np.testing.assert_array_equal(native.to_panels(odd), odd)


def test_a_rows_result_is_the_same_alone_and_in_a_threaded_batch():
    # 32 x 256 x 517 is split over threads; each output still sums over k in order
    rng = np.random.default_rng(1)
    x = jnp.asarray(_draw(rng, 32, 256))
    for n in (517, 512):  # row-major, and 8 panels
        w = jnp.asarray(native.to_panels(_draw(rng, 1, 256, n)))
        batch = np.asarray(native.layer_matmul(x, w))
        for r in (0, 5, 31):
            np.testing.assert_array_equal(np.asarray(native.layer_matmul(x[r : r + 1], w))[0], batch[r], err_msg=f"n {n}")
    # 100 rows at k 2048 run in row blocks of 48 (and 70 live rows end inside the second): the
    # rows at each block's edges as alone
    x = jnp.asarray(_draw(rng, 100, 2048))
    w = jnp.asarray(native.to_panels(_draw(rng, 1, 2048, 128)))
    for live in (100, 70):
        batch = np.asarray(native.layer_matmul(x, w, live=live))
        for r in (0, 47, 48, 69, 95, 99):
            alone = np.asarray(native.layer_matmul(x[r : r + 1], w))[0]
            np.testing.assert_array_equal(batch[r], alone if r < live else 0.0, err_msg=f"row {r} of {live} live")


def _silu_times_f64(gate, up):
    gate = gate.astype(np.float64)
    return gate / (1.0 + np.exp(-gate)) * up


@pytest.mark.parametrize("rows, k, ffn", [(1, 16, 64), (7, 40, 128), (13, 256, 768), (100, 2048, 64)])
def test_layer_matmul_glu_equals_float64_silu_of_gate_times_up(rows, k, ffn):
    # a row tile and less, two row tiles and a remainder, a threaded product, rows over three
    # row blocks; values spread wide enough that silu meets large negative and positive gates
    rng = np.random.default_rng(rows + ffn)
    x, w = _draw(rng, rows, k), _draw(rng, 2, k, 2, ffn) * (8.0 / np.sqrt(k))
    wp = jnp.asarray(native.to_panels(w))
    for layer in (0, 1):
        got = np.asarray(native.layer_matmul_glu(jnp.asarray(x), wp, layer))
        gate_up = x.astype(np.float64) @ w[layer].reshape(k, 2 * ffn).astype(np.float64)
        want = _silu_times_f64(gate_up[:, :ffn], gate_up[:, ffn:])
        assert got.shape == (rows, ffn)
        np.testing.assert_allclose(got, want, rtol=2e-5, atol=1e-5 * np.sqrt(k), err_msg=f"layer {layer}")
    # a row alone as in the batch, and rows past `live` zeros (NaN there never reaches the result)
    x[rows // 2 + 1 :] = np.nan
    live = rows // 2 + 1
    batch = np.asarray(native.layer_matmul_glu(jnp.asarray(x), wp, 1, live=live))
    np.testing.assert_array_equal(batch[live:], 0.0)
    alone = np.asarray(native.layer_matmul_glu(jnp.asarray(x[live - 1 : live]), wp, 1))
    np.testing.assert_array_equal(alone[0], batch[live - 1])


def test_layer_matmul_glu_silu_at_extreme_gates():
    # gates of -100 ... 100 through an identity-like product: silu(g) * 1 against float64
    g = np.array([-100.0, -88.0, -20.0, -1.0, -1e-3, 0.0, 1e-3, 1.0, 20.0, 100.0], np.float32)
    x = np.zeros((len(g), 64), np.float32)
    x[:, 0], x[:, 1] = g, 1.0
    w = np.zeros((1, 64, 2, 64), np.float32)
    w[0, 0, 0, :] = 1.0  # gate = x[:, 0]
    w[0, 1, 1, :] = 1.0  # up = x[:, 1] = 1
    got = np.asarray(native.layer_matmul_glu(jnp.asarray(x), jnp.asarray(native.to_panels(w))))
    want = _silu_times_f64(g.astype(np.float64), 1.0)
    np.testing.assert_allclose(got[:, 0], want, rtol=1e-6, atol=1e-30)
    np.testing.assert_allclose(got, np.repeat(got[:, :1], 64, axis=1))
    assert np.isfinite(got).all()


def test_layer_matmul_glu_names_kernels_it_cannot_split():
    x = jnp.zeros((2, 8), jnp.float32)
    for shape in ((1, 8, 2, 96), (1, 8, 3, 64), (1, 8, 128)):  # ffn not whole panels; not gate/up
        with pytest.raises(ValueError, match=r"\[layers, k, 2, ffn\]"):
            native.layer_matmul_glu(x, jnp.zeros(shape, jnp.float32))
    assert native.glu_applies((4, 8, 2, 128)) and not native.glu_applies((4, 8, 2, 96))


def _rope_f64(qkv, positions, group, theta=10000.0):
    """float64 rotate_half RoPE of the q and k heads of a fused [rows, kv, group + 2, head_dim]
    product, v as is: the oracle written out from Hugging Face's formula."""
    head_dim = qkv.shape[-1]
    half = head_dim // 2
    inv_freq = 1.0 / theta ** (np.arange(0, head_dim, 2) / head_dim)
    angles = np.concatenate([np.outer(positions, inv_freq)] * 2, axis=-1)[:, None, None, :]
    qk = qkv[:, :, : group + 1]
    rotated = np.concatenate([-qk[..., half:], qk[..., :half]], axis=-1)
    out = qkv.copy()
    out[:, :, : group + 1] = qk * np.cos(angles) + rotated * np.sin(angles)
    return out


# (rows, k, kv_heads, group, head_dim): a row, a row tile and a remainder, a threaded product;
# heads of 16 (eight lanes' halves: a scalar-looped epilogue), 32 and 64 (a whole column tile on
# AVX-512); one, two and three query heads a kv head
@pytest.mark.parametrize("rows, k, kv, group, head_dim", [(1, 16, 2, 2, 16), (13, 96, 3, 3, 64), (40, 256, 4, 2, 32), (9, 64, 4, 1, 32)])
def test_layer_matmul_rope_equals_float64_matmul_then_rope(rows, k, kv, group, head_dim):
    from cbjax.model.llama import rope_tables

    rng = np.random.default_rng(rows + head_dim)
    x, w = _draw(rng, rows, k), _draw(rng, 2, k, kv, group + 2, head_dim) / np.sqrt(k)
    positions = rng.integers(0, 4000, rows).astype(np.int32)  # angles of many turns
    assert native.rope_applies(w.shape, head_dim)
    wp = jnp.asarray(native.to_panels(w))
    cos, sin = rope_tables(jnp.asarray(positions), head_dim, 10000.0)
    for layer in (0, 1):
        got = np.asarray(native.layer_matmul_rope(jnp.asarray(x), wp, layer, cos, sin))
        qkv = np.tensordot(x.astype(np.float64), w[layer].astype(np.float64), 1)
        assert got.shape == (rows, kv, group + 2, head_dim)
        # f32 angles: cos and sin off by up to ~4000 * 2^-24 at position 4000 against float64's
        np.testing.assert_allclose(got, _rope_f64(qkv, positions, group), rtol=1e-4, atol=1e-3, err_msg=f"layer {layer}")
        # against the model's own XLA RoPE on the plain native product, to f32 rounding
        plain = native.layer_matmul(jnp.asarray(x), wp, layer)
        q = plain[:, :, :group].reshape(rows, kv * group, head_dim)
        from cbjax.model.llama import rope

        np.testing.assert_allclose(got[:, :, :group].reshape(rows, kv * group, head_dim),
                                   np.asarray(rope(q, jnp.asarray(positions), 10000.0)), rtol=1e-5, atol=1e-5)  # fmt: skip
        np.testing.assert_array_equal(got[:, :, group + 1], np.asarray(plain)[:, :, group + 1])  # v: the product itself
    # rows past `live` are zeros (NaN there never reaches the result), a row alone as in the batch
    x[rows // 2 + 1 :] = np.nan
    live = rows // 2 + 1
    batch = np.asarray(native.layer_matmul_rope(jnp.asarray(x), wp, 1, cos, sin, live=live))
    np.testing.assert_array_equal(batch[live:], 0.0)
    alone = np.asarray(native.layer_matmul_rope(jnp.asarray(x[live - 1 : live]), wp, 1, cos[live - 1 : live],
                                                sin[live - 1 : live]))  # fmt: skip
    np.testing.assert_array_equal(alone[0], batch[live - 1])


def test_layer_matmul_rope_names_what_it_cannot_take():
    x = jnp.zeros((2, 8), jnp.float32)
    cos = jnp.zeros((2, 16), jnp.float32)
    # columns not whole panels (2 x 3 x 16 = 96), a head of 12 (does not divide a column tile),
    # cos for another row count
    assert not native.rope_applies((1, 8, 2, 3, 16), 16) and not native.rope_applies((1, 8, 4, 4, 12), 12)
    for shape, c in (((1, 8, 2, 3, 16), cos), ((1, 8, 4, 4, 12), cos[:, :12]), ((1, 8, 2, 4, 16), cos[:1])):
        with pytest.raises(ValueError, match=r"layer_matmul_rope: .*\[layers, k, kv_heads, group \+ 2, head_dim\]"):
            native.layer_matmul_rope(x, jnp.zeros(shape, jnp.float32), 0, c, c)


def test_threaded_products_run_every_chunk_once_when_kernels_overlap():
    # Threaded products share one team of helper threads; a second kernel that finds the team
    # busy falls back to XLA's pool. Two Python threads, each a program of two independent
    # threaded products (XLA may run them at once), 20 times over: every result equals float64
    # numpy and, bit for bit, the same product run alone.
    import threading

    rng = np.random.default_rng(7)
    w, wt = _draw(rng, 1, 256, 512), _draw(rng, 512, 256)
    wp = jnp.asarray(native.to_panels(w))
    fn = jax.jit(lambda x: (native.layer_matmul(x, wp), native.matmul_nt(x, jnp.asarray(wt))))
    xs = [_draw(rng, 32, 256) for _ in range(2)]
    alone = [[np.asarray(y) for y in fn(jnp.asarray(x))] for x in xs]
    for x, (a, b) in zip(xs, alone):
        np.testing.assert_allclose(a, x.astype(np.float64) @ w[0].astype(np.float64), rtol=1e-5, atol=1e-4)
        np.testing.assert_allclose(b, x.astype(np.float64) @ wt.T.astype(np.float64), rtol=1e-5, atol=1e-4)
    failures = []

    def hammer(i):
        for _ in range(20):
            got = [np.asarray(y) for y in fn(jnp.asarray(xs[i]))]
            if not all(np.array_equal(g, w) for g, w in zip(got, alone[i])):
                failures.append(i)

    threads = [threading.Thread(target=hammer, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert failures == []


def test_only_the_live_rows_are_multiplied_and_the_padding_rows_are_zeros():
    # a step's padding tokens: rows past `live` (a traced count) give zeros, the others the
    # full product's exact values; live is clipped to [0, rows]
    rng = np.random.default_rng(2)
    x = _draw(rng, 32, 256)
    x[20:] = np.nan  # what the padding rows hold never reaches the result
    w = _draw(rng, 2, 256, 512)
    wp = jnp.asarray(native.to_panels(w))
    fn = jax.jit(lambda x, live: native.layer_matmul(x, wp, 1, live=live))
    full = np.asarray(native.layer_matmul(jnp.asarray(x[:20]), wp, 1))
    got = np.asarray(fn(jnp.asarray(x), jnp.int32(20)))
    np.testing.assert_array_equal(got[:20], full)
    np.testing.assert_array_equal(got[20:], 0.0)
    np.testing.assert_allclose(full, x[:20].astype(np.float64) @ w[1].astype(np.float64), rtol=1e-5, atol=1e-4)
    assert not np.asarray(fn(jnp.asarray(x), jnp.int32(-3))).any()
    assert np.isnan(np.asarray(fn(jnp.asarray(x), jnp.int32(99)))[20:]).all()
    wt = _draw(rng, 70, 40)
    xt = _draw(rng, 6, 40)
    xt[4:] = np.nan
    got = np.asarray(native.matmul_nt(jnp.asarray(xt), jnp.asarray(wt), live=4))
    np.testing.assert_array_equal(got[:4], np.asarray(native.matmul_nt(jnp.asarray(xt[:4]), jnp.asarray(wt))))
    np.testing.assert_array_equal(got[4:], 0.0)


@pytest.mark.parametrize("rows, k, n", [(1, 3, 5), (4, 64, 130), (7, 33, 9), (32, 40, 4099)])
def test_matmul_nt_equals_float64_numpy_and_is_the_same_alone_and_in_a_batch(rows, k, n):
    # k: whole vectors and a tail; n: column tiles of 4 and a remainder; the last shape is threaded
    rng = np.random.default_rng(rows + n)
    x, w = _draw(rng, rows, k), _draw(rng, n, k)
    got = np.asarray(native.matmul_nt(jnp.asarray(x), jnp.asarray(w)))
    np.testing.assert_allclose(got, x.astype(np.float64) @ w.T.astype(np.float64), rtol=1e-5, atol=1e-5 * np.sqrt(k))
    alone = np.asarray(native.matmul_nt(jnp.asarray(x[-1:]), jnp.asarray(w)))[0]
    np.testing.assert_array_equal(alone, got[-1])
    with pytest.raises(ValueError, match="on their last axes"):
        native.matmul_nt(jnp.asarray(x), jnp.asarray(w[:, :-1]))


def test_layer_matmul_names_shapes_that_do_not_contract():
    x, w = jnp.zeros((2, 8)), jnp.zeros((1, 6, 4))
    with pytest.raises(ValueError, match=r"x float32\[2, 8\] does not contract with w float32\[1, 6, 4\]"):
        native.layer_matmul(x, w)
    with pytest.raises(ValueError, match="both float32"):
        native.layer_matmul(jnp.zeros((2, 6), jnp.bfloat16), w)


def test_auto_runs_native_only_where_it_applies_and_native_says_why_not():
    assert native.ensure_registered() is None
    assert resolve_matmul("auto", "float32", False, "cpu") == "native"
    assert resolve_matmul("auto", "bfloat16", False, "cpu") == "xla"
    assert resolve_matmul("auto", "float32", True, "cpu") == "xla"
    assert resolve_matmul("auto", "float32", False, "gpu") == "xla"
    assert resolve_matmul("xla", "float32", False, "cpu") == "xla"
    with pytest.raises(ValueError, match="executor.matmul=native: it multiplies float32 only"):
        resolve_matmul("native", "bfloat16", False, "cpu")
    with pytest.raises(ValueError, match="executor.matmul=native: it runs on one device"):
        resolve_matmul("native", "float32", True, "cpu")
    with pytest.raises(ValueError, match="executor.matmul=native: it is a CPU kernel"):
        resolve_matmul("native", "float32", False, "tpu")
    with pytest.raises(ValueError, match="executor.matmul: unknown value 'blas'"):
        resolve_matmul("blas")
    with pytest.raises(ValueError, match="executor.matmul: unknown value 'blas'"):
        check_choices(RunConfig(executor=ExecutorConfig(name="jax", matmul="blas")))


def test_without_a_compiler_auto_falls_back_to_xla_and_native_names_why(no_compiler, capsys):
    assert resolve_matmul("auto", "float32", False, "cpu") == "xla"
    assert "executor.matmul=auto runs `xla` on this CPU" in capsys.readouterr().err
    with pytest.raises(ValueError, match="executor.matmul=native: .*no GCC C\\+\\+ compiler found"):
        resolve_matmul("native", "float32", False, "cpu")


# ---- greedy tokens (cbjax_greedy) ----


def _greedy_oracle(logits: np.ndarray, live: int) -> np.ndarray:
    """numpy: the first index of each live row's maximum, -1 for a row with a non-finite logit,
    0 past `live`."""
    want = np.zeros(logits.shape[0], np.int64)
    for r in range(min(live, logits.shape[0])):
        want[r] = np.argmax(logits[r]) if np.isfinite(logits[r]).all() else -1
    return want


@pytest.mark.parametrize("rows, vocab", [(1, 5), (4, 16), (6, 300), (33, 4103), (40, 20000)])
def test_greedy_is_the_first_maximum_and_marks_non_finite_rows(rows, vocab):
    rng = np.random.default_rng(rows * 7 + vocab)
    # few distinct values: many ties, so the first index matters in every lane
    logits = rng.integers(-4, 4, (rows, vocab)).astype(np.float32)
    logits[0, vocab // 2] = 9.0
    logits[0, vocab - 1] = 9.0  # a tie with an earlier index: the earlier wins
    if rows > 3:
        logits[1] = rng.standard_normal(vocab).astype(np.float32)  # distinct values
        logits[2, vocab - 1] = np.nan  # in the tail (or the vectors)
        logits[3, 0] = np.inf
    if rows > 5:
        logits[4] = -np.inf
        logits[5, :] = 3.0  # all equal: index 0
        logits[5, min(vocab - 1, 17)] = -np.inf
    for live in (rows, max(1, rows - 2)):
        got = np.asarray(native.greedy(jnp.asarray(logits), live))
        np.testing.assert_array_equal(got, _greedy_oracle(logits, live), err_msg=f"live {live}")


def test_greedy_equals_the_steps_xla_reductions():
    from cbjax.runtime.step import first_argmax

    rng = np.random.default_rng(3)
    logits = rng.integers(0, 3, (8, 4096)).astype(np.float32)
    logits[6, 100] = -np.inf
    xla = np.asarray(jnp.where(jnp.all(jnp.isfinite(logits), -1), first_argmax(jnp.asarray(logits)), -1))
    np.testing.assert_array_equal(np.asarray(jax.jit(native.greedy)(jnp.asarray(logits), jnp.int32(8))), xla)
    assert xla[6] == -1


def test_greedy_rejects_a_bad_logits_shape():
    with pytest.raises(ValueError, match=r"greedy: logits must be \[rows, vocab\]"):
        native.greedy(jnp.zeros((2, 3, 4)))


def test_embed_takes_the_table_rows_of_the_batchs_or_the_fed_tokens():
    rng = np.random.default_rng(5)
    table = rng.standard_normal((50, 24)).astype(np.float32)
    tokens = np.array([3, 0, 49, -1, 7, 60, 12], np.int32)  # -1 counts from the end; 60 is clipped
    feed = np.array([-1, 2, -1, -1, 0, -1, 1], np.int32)  # rows 1, 4 and 6 take the previous step's tokens
    prev = np.array([11, 22, 33], np.int32)
    got = np.asarray(jax.jit(native.embed)(jnp.asarray(table), jnp.asarray(tokens), jnp.asarray(feed), jnp.asarray(prev)))
    want_ids = [3, 33, 49, 49, 11, 49, 22]  # by hand
    np.testing.assert_array_equal(got, table[want_ids])
    # the same as the XLA select-and-gather the step ran before
    xla = jnp.asarray(table)[jnp.where(jnp.asarray(feed) >= 0, jnp.asarray(prev)[jnp.maximum(jnp.asarray(feed), 0)],
                                       jnp.asarray(tokens))]  # fmt: skip
    np.testing.assert_array_equal(got, np.asarray(xla))
    with pytest.raises(ValueError, match=r"embed: table must be float32 \[vocab, d\]"):
        native.embed(jnp.zeros((4,)), jnp.asarray(tokens), jnp.asarray(feed), jnp.asarray(prev))


# ---- the RMS norm before a matmul and the residual after ----


def _rms_norm_xla(x, scale, eps=1e-5):
    """The model's RMSNorm (cbjax.model.llama.RMSNorm) in XLA: its factor and its output."""
    factor = jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps)
    return factor, scale * (x * factor)


# rows: one, a row tile and a remainder, over the threaded norm pass (rows * k >= 65536), and past `live`
@pytest.mark.parametrize("rows, k", [(1, 64), (13, 128), (300, 256)])
def test_norm_prologue_and_residual_epilogue_equal_xla_around_the_matmul(rows, k):
    from cbjax.model.llama import rope_tables

    rng = np.random.default_rng(rows)
    x = jnp.asarray(_draw(rng, rows, k) * 3.0)
    scale = jnp.asarray(1.0 + 0.1 * _draw(rng, k))
    factor, normed = _rms_norm_xla(x, scale)
    live = rows - rows // 3
    w_rows = _draw(rng, 2, k, 192) / np.sqrt(k)
    w = jnp.asarray(native.to_panels(w_rows))
    residual = jnp.asarray(_draw(rng, rows, 192))
    # the plain matmul: normed in the kernel, bit for bit the same as normed by XLA before it
    want = np.asarray(native.layer_matmul(normed, w, 1, live=live))
    got = np.asarray(native.layer_matmul(x, w, 1, live=live, norm=(factor, scale)))
    np.testing.assert_array_equal(got, want)
    np.testing.assert_allclose(want[:live], np.asarray(normed, np.float64)[:live] @ w_rows[1].astype(np.float64),
                               rtol=1e-4, atol=1e-4)  # fmt: skip
    np.testing.assert_array_equal(want[live:], 0.0)
    # the residual: added as the tiles are stored, one f32 add as XLA's; the rows past live keep it
    got = np.asarray(native.layer_matmul(x, w, 1, live=live, norm=(factor, scale), residual=residual))
    np.testing.assert_array_equal(got, np.asarray(residual + jnp.asarray(want)))
    # the SwiGLU and the RoPE kernels take the same norm
    wg = jnp.asarray(native.to_panels(_draw(rng, 1, k, 2, 128) / np.sqrt(k)))
    np.testing.assert_array_equal(np.asarray(native.layer_matmul_glu(x, wg, 0, live=live, norm=(factor, scale))),
                                  np.asarray(native.layer_matmul_glu(normed, wg, 0, live=live)))  # fmt: skip
    wr = jnp.asarray(native.to_panels(_draw(rng, 1, k, 2, 2, 32) / np.sqrt(k)))
    cos, sin = rope_tables(jnp.arange(rows, dtype=jnp.int32), 32, 10000.0)
    np.testing.assert_array_equal(np.asarray(native.layer_matmul_rope(x, wr, 0, cos, sin, live, norm=(factor, scale))),
                                  np.asarray(native.layer_matmul_rope(normed, wr, 0, cos, sin, live)))  # fmt: skip


def test_norm_and_residual_shapes_are_named():
    x, w = jnp.zeros((3, 64), jnp.float32), jnp.zeros((1, 64, 64), jnp.float32)
    with pytest.raises(ValueError, match=r"norm: factor \[2\] must hold one value a row \(3\)"):
        native.layer_matmul(x, w, norm=(jnp.zeros((2,)), jnp.ones((64,))))
    with pytest.raises(ValueError, match=r"residual \[3, 32\] is not the product's \[3, 64\]"):
        native.layer_matmul(x, w, residual=jnp.zeros((3, 32)))
