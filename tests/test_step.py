"""The one-forward step against the dense, cache-free forward: mixed batches, every backend."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from cbjax.config import ModelConfig
from cbjax.model import Llama, forward_dense
from cbjax.model.llama import RMSNorm
from conftest import data_plan
from cbjax.core.request import Request
from cbjax.runtime.batch import BatchPacker
from cbjax.runtime.executor import to_device
from cbjax.runtime.kv_cache import KVCache
from cbjax.layout.shapes import plan_shapes
from cbjax.kernels.registry import GROUPED
from cbjax.runtime.step import first_argmax, model_step, split_model

PAGE_SIZE = 4
NUM_ROWS = 6
# (context already cached, new tokens) per row of the step under test: decodes, fresh
# prefills, chunks continuing context, lengths ending on and just past page boundaries. A
# first step prefills each row's context.
SECOND = {
    "decode_only": [(5, 1), (8, 1), (3, 1), (4, 1), (1, 1)],
    "prefill_only": [(0, 6), (0, 4), (0, 9)],
    "mixed": [(5, 1), (0, 7), (8, 4), (3, 1), (4, 5)],
    # 3 tokens: the 4-token bucket, smaller than the 6-row slot array (the LM head runs on 4 rows)
    "few_rows": [(5, 1), (8, 1), (3, 1)],
}


def sequences(seed, vocab):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, 24).tolist() for _ in range(NUM_ROWS)]


def req(i, seq, ctx, n):
    r = Request(request_id=str(i), arrival_s=0.0, prompt_len=ctx + n, prompt_token_ids=seq[: ctx + n])
    r.num_computed, r.num_new_tokens, r.slot = ctx, n, i
    return r


def run_step(weights, graphdef, attention, packer, cache, rows, seqs, pages, matmul="xla"):
    reqs = [req(i, seqs[i], ctx, n) for i, (ctx, n) in enumerate(rows)]
    plan = data_plan(num_slots=NUM_ROWS, prefills=reqs, page_tables={r.request_id: pages[int(r.request_id)] for r in reqs},
                    page_size=PAGE_SIZE)  # fmt: skip
    batch = to_device(packer.pack(plan))
    greedy, logits, cache = model_step(weights, cache, batch, graphdef=graphdef, attention=attention, matmul=matmul)
    logits = np.asarray(logits)
    assert logits.shape == (NUM_ROWS, weights[0]["embed_tokens"][...].shape[0]) and np.asarray(greedy).shape == (NUM_ROWS,)
    np.testing.assert_array_equal(np.asarray(greedy)[: len(rows)], np.argmax(logits[: len(rows)], axis=-1))
    return logits[: len(rows)], cache


# The XLA formulation over GQA groups 1, 2 and 4 (and with its native decode pass at 2 and 1);
# the Pallas kernel (interpreted on CPU, so slow to compile) at group 4, its own tests cover
# groups 1, 2 and 4 against the reference. The native matmul at groups 2 and 1, the second with
# every bias and a tied LM head (so the gate/up matmul and its SwiGLU run apart), and at group 2
# with an ffn of 96, not whole 64-column panels (apart too).
@pytest.mark.parametrize(
    "attention, num_kv_heads, matmul, extras",
    [("ragged", 4, "xla", False), ("ragged", 2, "xla", False), ("ragged", 1, "xla", False),
     pytest.param("native", 2, "native", False, marks=pytest.mark.native),
     pytest.param("native", 1, "native", True, marks=pytest.mark.native),
     pytest.param("native", 2, "native", "ffn96", marks=pytest.mark.native),
     ("pallas", 1, "xla", False)],
)  # fmt: skip
def test_mixed_batch_logits_equal_the_dense_forward(attention, num_kv_heads, matmul, extras):
    more = dict(attention_bias=True, o_proj_bias=True, mlp_bias=True, tie_embeddings=True) if extras is True else {}
    if extras == "ffn96":
        more = dict(ffn_dim=96)
    cfg = ModelConfig(num_heads=4, num_kv_heads=num_kv_heads, max_model_len=32, **more)
    model = Llama(cfg, seed=1)
    # every norm its own scale (the init's are ones): a norm applied in the wrong place shows
    norm_rng = np.random.default_rng(7)
    for _, node in nnx.iter_graph(model):
        if isinstance(node, RMSNorm):
            node.scale[...] = jnp.asarray(1.0 + 0.2 * norm_rng.standard_normal(node.scale[...].shape), jnp.float32)
    graphdef, weights = split_model(model.fused(), matmul)
    dense_def, dense_state = nnx.split(model)
    dense_fn = jax.jit(lambda state, tokens: forward_dense(nnx.merge(dense_def, state), tokens))

    def dense_last(tokens):  # padded to one length: causal attention makes the padding invisible
        padded = np.zeros(cfg.max_model_len, np.int32)
        padded[: len(tokens)] = tokens
        return np.asarray(dense_fn(dense_state, jnp.asarray(padded)))[len(tokens) - 1]
    shapes = plan_shapes(NUM_ROWS, cfg.max_model_len, PAGE_SIZE, 32, token_buckets=[4, 32])
    rng = np.random.default_rng(num_kv_heads)
    num_pages = 64
    perm = rng.permutation(np.arange(1, num_pages))
    pages = [perm[i * 8 : (i + 1) * 8].tolist() for i in range(NUM_ROWS)]  # 8 pages = 32 tokens a row
    seqs = sequences(num_kv_heads, cfg.vocab_size)
    for name, second in SECOND.items():
        # every page NaN until written: reading past a length or an unwritten slot poisons the logits
        shape = (cfg.num_layers, num_kv_heads, num_pages, PAGE_SIZE, cfg.head_dim)
        cache = KVCache(k=jnp.full(shape, jnp.nan), v=jnp.full(shape, jnp.nan))
        packer = BatchPacker(shapes, tiles=attention in GROUPED)
        if any(ctx for ctx, _ in second):  # cache the context the second step continues from (checked too)
            first = [(0, ctx or 1) for ctx, _ in second]
            got, cache = run_step(weights, graphdef, attention, packer, cache, first, seqs, pages, matmul)
            for i, (ctx, n) in enumerate(first):
                want = dense_last(seqs[i][: ctx + n])
                np.testing.assert_allclose(got[i], want, rtol=1e-5, atol=1e-5, err_msg=f"{name} setup row {i}")
        got, cache = run_step(weights, graphdef, attention, packer, cache, second, seqs, pages, matmul)
        for i, (ctx, n) in enumerate(second):
            want = dense_last(seqs[i][: ctx + n])
            np.testing.assert_allclose(got[i], want, rtol=1e-5, atol=1e-5, err_msg=f"{name} row {i} ({ctx}+{n})")


def test_inconsistent_batch_shapes_name_them():
    cfg = ModelConfig(max_model_len=16)
    graphdef, weights = split_model(Llama(cfg, seed=0).fused())
    shapes = plan_shapes(2, 16, PAGE_SIZE, 8, token_buckets=[8])
    batch = to_device(BatchPacker(shapes, tiles=False).empty(8))
    bad = dataclasses.replace(batch, positions=batch.positions[:4])
    shape = (cfg.num_layers, cfg.num_kv_heads, 8, PAGE_SIZE, cfg.head_dim)
    cache = KVCache(k=jnp.zeros(shape), v=jnp.zeros(shape))
    with pytest.raises(ValueError, match=r"inconsistent batch shapes: tokens \(8,\), positions \(4,\)"):
        model_step(weights, cache, bad, graphdef=graphdef, attention="reference")
    bad = dataclasses.replace(batch, prev_tokens=batch.prev_tokens[:1])
    with pytest.raises(ValueError, match=r"feed \(8,\), prev_tokens \(1,\)"):
        model_step(weights, cache, bad, graphdef=graphdef, attention="reference")
    # weights laid out for one implementation are refused by another, naming both
    with pytest.raises(ValueError, match=r"matmul='other' needs weights from split_model\(model, matmul='other'\), "
                                         r"got weights split for 'xla'"):  # fmt: skip
        model_step(weights, cache, batch, graphdef=graphdef, attention="reference", matmul="other")
    with pytest.raises(ValueError, match="split_model: matmul must be a resolved name .*, got 'auto'"):
        split_model(Llama(cfg, seed=0).fused(), "auto")
    with pytest.raises(ValueError, match="executor.matmul: 'bogus' is not a registered implementation"):
        split_model(Llama(cfg, seed=0).fused(), "bogus")


def test_first_argmax_is_the_first_maximum():
    logits = np.array([[1.0, 3.0, 3.0, 2.0], [5.0, 5.0, 5.0, 5.0], [-1.0, -3.0, -1.0, -2.0], [0.0, 0.0, 0.0, 7.0]], np.float32)
    np.testing.assert_array_equal(np.asarray(first_argmax(jnp.asarray(logits))), [1, 0, 0, 3])
    rng = np.random.default_rng(0)
    wide = rng.integers(0, 8, (5, 300)).astype(np.float32)  # many ties
    np.testing.assert_array_equal(np.asarray(first_argmax(jnp.asarray(wide))), np.argmax(wide, axis=-1))


def _result_sizes(hlo: str, op: str) -> list[int]:
    """Element counts of the results of every `op` instruction (copy, fusion, ...) in `hlo`."""
    import math
    import re

    return [math.prod(int(x) for x in m.group(1).split(",") if x)
            for m in re.finditer(rf"= [a-z0-9]+\[([\d,]*)\]\{{[^}}]*\}} {op}\(", hlo)]  # fmt: skip


@pytest.mark.parametrize("attention", ["pallas", "ragged"])
def test_the_compiled_step_copies_no_layer_of_the_cache(attention):
    # Every backend reads the layer's pages from the whole stacked cache (the Pallas kernel takes
    # the layer index as a scalar): no instruction materializes one layer's pages (a slice of the
    # scan's carry), and none copies the whole cache. 37 pages: a size no other array shares.
    cfg = ModelConfig(max_model_len=32)
    graphdef, weights = split_model(Llama(cfg, seed=0).fused())
    shape = (cfg.num_layers, cfg.num_kv_heads, 37, PAGE_SIZE, cfg.head_dim)
    cache = KVCache(k=jnp.zeros(shape), v=jnp.zeros(shape))
    shapes = plan_shapes(NUM_ROWS, cfg.max_model_len, PAGE_SIZE, 8, token_buckets=[8])
    batch = to_device(BatchPacker(shapes, tiles=attention in GROUPED).empty(8))
    hlo = model_step.lower(weights, cache, batch, graphdef=graphdef, attention=attention).compile().as_text()
    layer, whole = int(np.prod(shape[1:])), int(np.prod(shape))
    for op in ("copy", "fusion", "dynamic-slice", "slice"):
        sizes = _result_sizes(hlo, op)
        assert layer not in sizes, f"{op}: a layer of the cache materialized"
        if op != "fusion":  # the K/V write is an in-place scatter fusion over the whole cache
            assert whole not in sizes, f"{op}: the whole cache copied"
