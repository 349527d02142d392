"""The NNX Llama: dense forward vs a float64 oracle, fused layout, partitioning metadata, jit boundary."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P
from llama_fixtures import BIASED, QWEN_LIKE, TINY, dense, dense_logits, numpy_forward, scaled_llama

from cbjax.model import Llama, forward_dense, kv_cache_axes
from cbjax.runtime.kv_cache import init_cache
from cbjax.model.llama import LOGICAL_AXES
from cbjax.runtime.compiles import compile_count

# f32 against float64: only rounding differs. Logits are O(1).
ATOL = RTOL = 1e-4

CONFIGS = {"tiny": TINY, "qwen_like": QWEN_LIKE, "biased": BIASED}


def _tokens(cfg, n, seed=0):
    return np.random.default_rng(seed).integers(0, cfg.vocab_size, n).astype(np.int32)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_dense_forward_matches_float64_reference(name):
    """GQA 2:1 and 4:1, q/k/v, o_proj and MLP biases, tied embeddings, rope theta 1e6."""
    cfg = CONFIGS[name]
    model = scaled_llama(cfg)
    tokens = _tokens(cfg, 13)
    want = numpy_forward(model, cfg, tokens)
    got = dense(model, tokens)
    assert got.shape == (13, cfg.vocab_size) and got.dtype == np.float32
    np.testing.assert_allclose(got, want, atol=ATOL, rtol=RTOL)
    # the step's interface takes any leading dims: shapes only, no compile
    x = jax.ShapeDtypeStruct((2, 5, cfg.d_model), jnp.float32)
    q, k, v = jax.eval_shape(model.layers[0].qkv, x, jax.ShapeDtypeStruct((2, 5), jnp.int32))
    assert q.shape == (2, 5, cfg.num_heads, cfg.head_dim)
    assert k.shape == v.shape == (2, 5, cfg.num_kv_heads, cfg.head_dim)
    assert jax.eval_shape(model.layers[0].finish, x, q).shape == (2, 5, cfg.d_model)
    assert jax.eval_shape(model.logits, x).shape == (2, 5, cfg.vocab_size)


def test_fused_layout_computes_the_same_logits():
    cfg = BIASED  # every bias, GQA 4:1
    model = scaled_llama(cfg)
    fused = model.fused()
    assert fused.is_fused and not model.is_fused  # the original is left unfused
    layer = fused.layers[0]
    group = cfg.num_heads // cfg.num_kv_heads
    assert layer.qkv_proj.kernel.shape == (cfg.d_model, cfg.num_kv_heads, group + 2, cfg.head_dim)
    assert layer.q_proj is None and layer.gate_proj is None
    assert layer.gate_up_proj.kernel.shape == (cfg.d_model, 2, cfg.ffn_dim)
    assert (layer.qkv_proj.bias is not None) == cfg.attention_bias
    tokens = _tokens(cfg, 11, seed=1)
    np.testing.assert_allclose(dense(fused, tokens), dense(model, tokens), atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="already fused"):
        fused.fused()
    unbiased = nnx.eval_shape(lambda: Llama(TINY, seed=None).fused()).layers[0]
    assert unbiased.qkv_proj.bias is None and unbiased.gate_up_proj.bias is None


# Expected (shape, axes) per parameter, from the table in cbjax/model/llama.py.
def _expected_axes(cfg, fused):
    d, h, kv, hd, f, vocab = cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.ffn_dim, cfg.vocab_size
    layer, biases = {}, {}
    layer[("input_layernorm", "scale")] = layer[("post_attention_layernorm", "scale")] = ((d,), ("embed",))
    layer[("o_proj", "kernel")] = ((h, hd, d), ("heads", "head_dim", "embed"))
    layer[("down_proj", "kernel")] = ((f, d), ("mlp", "embed"))
    biases["o_proj"] = {("o_proj", "bias"): ((d,), ("embed",))}
    biases["mlp"] = {("down_proj", "bias"): ((d,), ("embed",))}
    biases["qkv"] = {}
    if fused:
        layer[("qkv_proj", "kernel")] = ((d, kv, h // kv + 2, hd), ("embed", "kv_heads", None, "head_dim"))
        biases["qkv"][("qkv_proj", "bias")] = ((kv, h // kv + 2, hd), ("kv_heads", None, "head_dim"))
        layer[("gate_up_proj", "kernel")] = ((d, 2, f), ("embed", None, "mlp"))
        biases["mlp"][("gate_up_proj", "bias")] = ((2, f), (None, "mlp"))
    else:
        for name, n, axis in (("q_proj", h, "heads"), ("k_proj", kv, "kv_heads"), ("v_proj", kv, "kv_heads")):
            layer[(name, "kernel")] = ((d, n, hd), ("embed", axis, "head_dim"))
            biases["qkv"][(name, "bias")] = ((n, hd), (axis, "head_dim"))
        for name in ("gate_proj", "up_proj"):
            layer[(name, "kernel")] = ((d, f), ("embed", "mlp"))
            biases["mlp"][(name, "bias")] = ((f,), ("mlp",))
    for kind, flag in (("qkv", cfg.attention_bias), ("o_proj", cfg.o_proj_bias), ("mlp", cfg.mlp_bias)):
        if flag:
            layer.update(biases[kind])
    out = {("embed_tokens",): ((vocab, d), ("vocab", "embed")), ("norm", "scale"): ((d,), ("embed",))}
    if not cfg.tie_embeddings:
        out[("lm_head",)] = ((d, vocab), ("embed", "vocab"))
    for i in range(cfg.num_layers):
        out.update({("layers", i, *key): value for key, value in layer.items()})
    return out


@pytest.mark.parametrize("name,fused", [("biased", False), ("biased", True), ("qwen_like", False)])
def test_every_parameter_carries_logical_axes(name, fused):
    cfg = CONFIGS[name]
    model = Llama(cfg, seed=0)
    model = model.fused() if fused else model
    expected = _expected_axes(cfg, fused)
    params = {path: node for path, node in nnx.iter_graph(model) if isinstance(node, nnx.Param)}
    assert set(params) == set(expected)
    for path, p in params.items():
        axes = p.get_metadata()["out_sharding"]
        assert set(axes) <= set(LOGICAL_AXES) | {None}, path
        assert (p.shape, axes) == expected[path], path
    # the sharding issue's 1:1 mapping: heads, kv_heads and mlp onto one tensor-parallel mesh axis
    rules = [("heads", "tp"), ("kv_heads", "tp"), ("mlp", "tp"), ("vocab", None), ("embed", None), ("head_dim", None)]
    with nnx.logical_axis_rules(rules):
        specs = nnx.get_partition_spec(nnx.state(model))
    layer = specs["layers"][0]
    if fused:
        assert layer["qkv_proj"]["kernel"].get_value() == P(None, "tp", None, None)
        assert layer["gate_up_proj"]["kernel"].get_value() == P(None, None, "tp")
    else:
        assert layer["q_proj"]["kernel"].get_value() == P(None, "tp", None)
        assert layer["gate_proj"]["kernel"].get_value() == P(None, "tp")
    assert layer["o_proj"]["kernel"].get_value() == P("tp", None, None)
    assert layer["down_proj"]["kernel"].get_value() == P("tp", None)


def test_kv_cache_axes_name_the_cache_layout():
    cache = init_cache(BIASED.num_layers, BIASED.num_kv_heads, BIASED.head_dim, 3, 2, BIASED.dtype)  # [num_layers, num_kv_heads, num_pages, page_size, head_dim]
    assert len(kv_cache_axes) == cache.k.ndim and set(kv_cache_axes) <= set(LOGICAL_AXES) | {None}
    sizes = dict(zip(kv_cache_axes, cache.k.shape))
    assert sizes["kv_heads"] == BIASED.num_kv_heads and sizes["head_dim"] == BIASED.head_dim


def test_jit_over_split_state_reuses_the_program_for_new_weights():
    cfg = QWEN_LIKE
    tokens = _tokens(cfg, 9, seed=2)
    graphdef, state = nnx.split(scaled_llama(cfg, seed=0))
    first = np.asarray(dense_logits(graphdef, state, tokens))
    before = compile_count()
    other = scaled_llama(cfg, seed=1)  # building a model compiles nothing either
    graphdef2, state2 = nnx.split(other)
    second = np.asarray(dense_logits(graphdef2, state2, tokens))
    assert compile_count() == before
    assert graphdef2 == graphdef and hash(graphdef2) == hash(graphdef)
    assert np.abs(second - first).max() > 1e-2  # the new weights were used
    np.testing.assert_allclose(second, numpy_forward(other, cfg, tokens), atol=ATOL, rtol=RTOL)


def test_construction_from_a_seed_is_host_side_and_deterministic():
    before = compile_count()
    a, b = Llama(TINY, seed=5), Llama(TINY, seed=5)
    assert compile_count() == before
    kernel = np.asarray(a.layers[1].q_proj.kernel[...])
    assert np.array_equal(kernel, np.asarray(b.layers[1].q_proj.kernel[...]))
    assert abs(kernel.std() - 0.02) < 0.002 and np.all(np.asarray(a.norm.scale[...]) == 1)
    abstract = nnx.eval_shape(lambda: Llama(TINY, seed=None))
    assert isinstance(abstract.embed_tokens.get_value(), jax.ShapeDtypeStruct)
    assert abstract.layers[0].o_proj.kernel.shape == (4, 16, 64)
    bf16 = Llama(dataclasses.replace(TINY, dtype="bfloat16"), seed=5)
    assert bf16.layers[1].q_proj.kernel[...].dtype == jnp.bfloat16


def test_unsupported_architectures_and_bad_inputs_raise():
    with pytest.raises(ValueError, match="model.mlp"):
        Llama(dataclasses.replace(TINY, mlp="plain"), seed=0)
    with pytest.raises(ValueError, match="model.head_dim must be even"):
        Llama(dataclasses.replace(TINY, head_dim=15), seed=0)
    with pytest.raises(ValueError, match=r"forward_dense: tokens must be \[T\], got shape \(2, 3\)"):
        forward_dense(Llama(TINY, seed=0), jnp.zeros((2, 3), jnp.int32))
