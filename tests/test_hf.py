"""Hugging Face checkpoints: cbjax must match transformers token for token on the same weights.

Tiny random models are built from configs with transformers (no downloads), saved with
`save_pretrained` and loaded by `cbjax.model.hf`. Everything runs in f32.
"""

from __future__ import annotations

import collections
import functools
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from cbjax.config import (  # noqa: E402
    CacheConfig, ExecutorConfig, ModelConfig, RunConfig, SchedulerConfig, WorkloadConfig,
)  # fmt: skip
from cbjax.engine.offline import serve  # noqa: E402
from cbjax.model import forward_dense  # noqa: E402
from cbjax.model.hf import load_config, load_model, name_map  # noqa: E402
from conftest import data_plan  # noqa: E402
from cbjax.model.tokenizer import load_tokenizer  # noqa: E402
from cbjax.core.request import FinishReason, Request, SamplingParams  # noqa: E402
from cbjax.app.run import run_single  # noqa: E402
from cbjax.runtime.batch import BatchPacker  # noqa: E402
from cbjax.runtime.executor import JaxExecutor, to_device  # noqa: E402
from cbjax.runtime.kv_cache import init_cache  # noqa: E402
from cbjax.layout.shapes import plan_shapes  # noqa: E402
from cbjax.runtime.step import model_step, split_model  # noqa: E402
from cbjax.scheduler import Scheduler  # noqa: E402
from cbjax.workload.trace import encode_text_prompts, load_trace  # noqa: E402

# f32 on both sides; only the order of sums differs. Logits are O(1) (weights ~ N(0, 0.1)).
LOGITS_ATOL = 1e-4
LOGITS_RTOL = 1e-4

MAX_MODEL_LEN = 128
PAGE_SIZE = 4
BUCKETS = [4, 64]  # two token buckets: few compiles
BUDGET = 64
NUM_PAGES = 256
NUM_DECODE_STEPS = 12
NUM_SLOTS = 4

COMMON = dict(
    vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, max_position_embeddings=256,
    rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2,
)  # fmt: skip
ARCHS = {
    # explicit head_dim (24, not 64 / 4), GQA 4:2, biases on q/k/v/o, untied head, rope_theta 5e5
    "llama": ("LlamaConfig", "LlamaForCausalLM",
              dict(num_attention_heads=4, num_key_value_heads=2, head_dim=24, attention_bias=True,
                   rope_theta=500000.0, tie_word_embeddings=False)),
    # Qwen2: q/k/v biases, GQA 8:2, tied embeddings, rope_theta 1e6
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM",
              dict(num_attention_heads=8, num_key_value_heads=2, rope_theta=1e6, tie_word_embeddings=True)),
}  # fmt: skip


def build_hf(arch: str, out_dir, seed: int = 0, dtype=None, **changes):
    """A random transformers model saved to `out_dir`; every weight ~ N(0, 0.1), norms ~ 1.
    `changes` replace the arch's config keys."""
    config_cls, model_cls, kw = ARCHS[arch]
    config = getattr(transformers, config_cls)(**COMMON, **{**kw, **changes})
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.1)
    if dtype is not None:
        model = model.to(dtype)
    model.save_pretrained(str(out_dir))
    return model


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """checkpoint(arch) -> (transformers model, model dir, resolved cbjax ModelConfig), built once."""
    built = {}

    def get(arch: str):
        if arch not in built:
            out_dir = str(tmp_path_factory.mktemp(f"hf_{arch}"))
            model = build_hf(arch, out_dir)
            cfg = load_config(ModelConfig(name="hf", path=out_dir, dtype="auto", max_model_len=MAX_MODEL_LEN))
            built[arch] = (model, out_dir, cfg)
        return built[arch]

    return get


@functools.partial(jax.jit, static_argnums=0)
def _dense_logits(graphdef, state, tokens):
    return forward_dense(nnx.merge(graphdef, state), tokens)


def dense(model, tokens) -> np.ndarray:
    """forward_dense of an NNX Llama, jitted over its split state."""
    return np.asarray(_dense_logits(*nnx.split(model), jnp.asarray(tokens, jnp.int32)))


def hf_logits(model, tokens) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0].numpy()


def assert_logits_close(got, want, what):
    err = np.abs(np.asarray(got) - want)
    bound = LOGITS_ATOL + LOGITS_RTOL * np.abs(want)
    assert (err <= bound).all(), f"{what}: max |diff| {err.max():.2e}"


# ---- loader ----
@pytest.mark.parametrize("arch", list(ARCHS))
def test_config_json_maps_onto_model_config(checkpoint, arch):
    _, _, cfg = checkpoint(arch)
    kw = ARCHS[arch][2]
    assert (cfg.vocab_size, cfg.d_model, cfg.num_layers, cfg.ffn_dim) == (512, 64, 2, 128)
    assert (cfg.num_heads, cfg.num_kv_heads) == (kw["num_attention_heads"], kw["num_key_value_heads"])
    assert cfg.head_dim == kw.get("head_dim", 64 // kw["num_attention_heads"])
    assert cfg.rope_theta == kw["rope_theta"] and cfg.tie_embeddings == kw["tie_word_embeddings"]
    assert cfg.attention_bias and cfg.dtype == "float32" and cfg.eos_token_id == 2 and cfg.norm_eps == 1e-6
    assert cfg.o_proj_bias == (arch == "llama") and not cfg.mlp_bias  # Llama's attention_bias covers o_proj
    assert cfg.max_model_len == MAX_MODEL_LEN
    full = load_config(ModelConfig(path=cfg.path, dtype="auto", max_model_len=0))
    assert full.max_model_len == 256  # max_position_embeddings


@pytest.mark.parametrize("arch", list(ARCHS))
def test_dense_forward_matches_transformers_at_every_position(checkpoint, arch):
    model, _, cfg = checkpoint(arch)
    ours = load_model(cfg)
    tokens = np.random.default_rng(1).integers(0, cfg.vocab_size, 57).tolist()
    want = hf_logits(model, tokens)
    assert_logits_close(dense(ours, tokens), want, f"{arch} dense forward")
    assert_logits_close(dense(ours.fused(), tokens), want, f"{arch} dense forward, fused layout")


@pytest.mark.parametrize("arch", list(ARCHS))
def test_name_map_fills_every_parameter_in_the_module_layout(checkpoint, arch):
    """Each Hugging Face tensor lands at its module path: linear weights transposed and split
    into heads, biases split into heads, norms as they are."""
    model, _, cfg = checkpoint(arch)
    ours = load_model(cfg)
    module_params = {path for path, node in nnx.iter_graph(ours) if isinstance(node, nnx.Param)}
    mapped = [t.path for t in name_map(cfg).values()]
    assert sorted(map(str, mapped)) == sorted(map(str, module_params)) and len(set(mapped)) == len(mapped)
    theirs = {name: p.detach().numpy() for name, p in model.named_parameters()}
    d, h, kv, hd = cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    layer = ours.layers[1]
    attn = "model.layers.1.self_attn"
    np.testing.assert_array_equal(layer.q_proj.kernel[...], theirs[f"{attn}.q_proj.weight"].T.reshape(d, h, hd))
    np.testing.assert_array_equal(layer.v_proj.kernel[...], theirs[f"{attn}.v_proj.weight"].T.reshape(d, kv, hd))
    np.testing.assert_array_equal(layer.k_proj.bias[...], theirs[f"{attn}.k_proj.bias"].reshape(kv, hd))
    np.testing.assert_array_equal(layer.o_proj.kernel[...], theirs[f"{attn}.o_proj.weight"].T.reshape(h, hd, d))
    assert (layer.o_proj.bias is not None) == (arch == "llama")
    np.testing.assert_array_equal(layer.down_proj.kernel[...], theirs["model.layers.1.mlp.down_proj.weight"].T)
    np.testing.assert_array_equal(ours.norm.scale[...], theirs["model.norm.weight"])
    np.testing.assert_array_equal(ours.embed_tokens[...], theirs["model.embed_tokens.weight"])
    assert (ours.lm_head is None) == cfg.tie_embeddings


@pytest.mark.parametrize("arch", list(ARCHS))
def test_paged_prefill_and_every_decode_step_match_transformers(checkpoint, arch):
    """Three prompts share the paged cache (pages permuted) in the one-forward step: one mixed
    prefill step, then NUM_DECODE_STEPS decode steps feeding back transformers' greedy choice;
    logits compared at each step."""
    model, _, cfg = checkpoint(arch)
    graphdef, weights = split_model(load_model(cfg).fused())
    rng = np.random.default_rng(2)
    prompts = [rng.integers(0, cfg.vocab_size, n).tolist() for n in (5, 16, 11)]
    num_slots, max_pages = len(prompts), 8
    pages = rng.permutation(np.arange(1, 1 + num_slots * max_pages)).reshape(num_slots, max_pages).tolist()
    shapes = plan_shapes(num_slots, max_pages * PAGE_SIZE, PAGE_SIZE, 32, token_buckets=[4, 32])
    packer = BatchPacker(shapes, tiles=True)
    cache = init_cache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, 1 + num_slots * max_pages, PAGE_SIZE, cfg.dtype)
    seqs = [list(p) for p in prompts]
    reqs = [Request(str(i), 0.0, len(p), list(p)) for i, p in enumerate(prompts)]
    for i, r in enumerate(reqs):
        r.slot, r.num_computed, r.num_new_tokens = i, 0, len(prompts[i])
    for step in range(NUM_DECODE_STEPS + 1):
        plan = data_plan(num_slots=num_slots, prefills=reqs if step == 0 else [], decodes=reqs if step else [],
                        page_tables={r.request_id: pages[i] for i, r in enumerate(reqs)}, page_size=PAGE_SIZE)  # fmt: skip
        _, logits, cache = model_step(weights, cache, to_device(packer.pack(plan)), graphdef=graphdef, attention="ragged")
        for i, seq in enumerate(seqs):
            want = hf_logits(model, seq)[-1]
            assert_logits_close(logits[i], want, f"{arch} slot {i} {'prefill' if step == 0 else f'decode {step}'}")
            seq.append(int(want.argmax()))
        for r, seq in zip(reqs, seqs):  # the next step decodes the token just chosen
            r.num_computed += r.num_new_tokens
            r.num_new_tokens = 1
            r.output_token_ids = seq[r.prompt_len :]


def hf_greedy(model, prompts, max_new_tokens, eos_token_id=None):
    """transformers' greedy `generate` over all prompts in one left-padded batch; each output is
    cut to its own max_new_tokens and after its first EOS (`eos_token_id`: an id or a list)."""
    longest = max(len(p) for p in prompts)
    ids = torch.zeros((len(prompts), longest), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, longest - len(p) :] = torch.tensor(p)
        mask[i, longest - len(p) :] = 1
    with torch.no_grad():
        out = model.generate(
            input_ids=ids, attention_mask=mask, max_new_tokens=max(max_new_tokens), do_sample=False, pad_token_id=0
        )[:, longest:].tolist()
    eos = set(eos_token_id) if isinstance(eos_token_id, list) else {eos_token_id}
    outputs = []
    for row, n in zip(out, max_new_tokens):
        row = row[:n]
        ends = [i for i, t in enumerate(row) if t in eos]
        outputs.append(row[: ends[0] + 1] if ends else row)
    return outputs


def cb_requests(cfg) -> list[Request]:
    """18 prompts of 1-60 tokens, 1-24 new tokens each."""
    rng = np.random.default_rng(3)
    reqs = []
    for i in range(18):
        prompt = rng.integers(3, cfg.vocab_size, int(rng.integers(1, 61))).tolist()
        sampling = SamplingParams(max_tokens=int(rng.integers(1, 25)))
        reqs.append(Request(str(i), 0.001 * i, len(prompt), prompt, sampling))
    return reqs


def assert_cb_equals_generate(model, cfg, what):
    """`cb_requests` through 4 slots (slots are refilled): the engine's greedy tokens equal
    transformers' `generate`; every EOS id of the checkpoint is honoured on both sides.
    Returns the engine's run."""
    reqs = cb_requests(cfg)
    sched_cfg = SchedulerConfig(max_num_seqs=NUM_SLOTS, max_num_batched_tokens=BUDGET)
    cache = CacheConfig(num_pages=NUM_PAGES, page_size=PAGE_SIZE)
    ex_cfg = ExecutorConfig(name="jax", token_buckets=BUCKETS)
    ex = JaxExecutor(cfg, cache, sched_cfg, ex_cfg, llama=load_model(cfg))
    sched = Scheduler(
        sched_cfg, cache, cfg.max_model_len, validate=ex.validate, eos_token_id=cfg.eos_token_id, vocab_size=cfg.vocab_size,
        extra_eos_token_ids=cfg.extra_eos_token_ids,
    )  # fmt: skip
    ex.warmup()
    result = serve(reqs, sched, ex)
    assert result.stats.batch_peak == NUM_SLOTS and ex.metrics()["compiles_after_warmup"] == 0
    eos = [cfg.eos_token_id, *cfg.extra_eos_token_ids]
    want = hf_greedy(model, [r.prompt_token_ids for r in reqs], [r.sampling.max_tokens for r in reqs], eos)
    for req, expected in zip(result.requests, want):
        assert req.output_token_ids == expected, f"{what} request {req.request_id}"
        assert req.finish_reason in (FinishReason.LENGTH, FinishReason.EOS)
    return result


def test_every_eos_id_of_generation_config_ends_a_request(tmp_path):
    """A generation_config.json listing several eos ids (Llama 3 Instruct's three): a request
    ends on any of them, as in `generate`. The two extra ids are tokens the greedy outputs
    reach, so several requests end on them."""
    model = build_hf("qwen2", tmp_path, seed=7)
    reqs = cb_requests(load_config(ModelConfig(name="hf", path=str(tmp_path), dtype="auto", max_model_len=MAX_MODEL_LEN)))
    model.generation_config.eos_token_id = None  # every output at its full length
    outs = hf_greedy(model, [r.prompt_token_ids for r in reqs], [r.sampling.max_tokens for r in reqs])
    counts = collections.Counter(t for out in outs for t in out[:-1] if t != 2)
    extra = [t for t, _ in counts.most_common(2)]
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, *extra, 2]}))
    cfg = load_config(ModelConfig(name="hf", path=str(tmp_path), dtype="auto", max_model_len=MAX_MODEL_LEN))
    assert (cfg.eos_token_id, cfg.extra_eos_token_ids) == (2, extra)  # the repeated 2 once
    model.generation_config.eos_token_id = [2, *extra]
    result = assert_cb_equals_generate(model, cfg, "several eos ids")
    ended = [r for r in result.requests if r.finish_reason == FinishReason.EOS and r.output_token_ids[-1] in extra]
    assert len(ended) >= 3


@pytest.mark.parametrize("arch", list(ARCHS))
def test_continuous_batching_greedy_equals_transformers_generate(checkpoint, arch):
    model, _, cfg = checkpoint(arch)
    assert_cb_equals_generate(model, cfg, arch)


# RoPE scaling, as Llama 3.1+ and position-interpolated checkpoints set it. Llama 3.1's on a
# 64-token training context: head_dim 16 at theta 5e5 has wavelengths from 6 to ~6e5 tokens,
# so one frequency is kept (under 64 / 4 = 16 tokens), one blended and six divided (over 64).
# No biases and heads of 16: on a CPU the fused q/k/v product takes the native kernels' RoPE
# epilogue where they build.
SCALED_ROPE = {
    "llama3": dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                   original_max_position_embeddings=64),
    "linear": dict(rope_type="linear", factor=2.0),
}  # fmt: skip


@pytest.mark.parametrize("kind", list(SCALED_ROPE))
def test_scaled_rope_matches_transformers(tmp_path, kind):
    model = build_hf("llama", tmp_path, seed=5, head_dim=16, attention_bias=False,
                     rope_parameters={"rope_theta": 500000.0, **SCALED_ROPE[kind]})  # fmt: skip
    cfg = load_config(ModelConfig(name="hf", path=str(tmp_path), dtype="auto", max_model_len=MAX_MODEL_LEN))
    assert (cfg.rope_type, cfg.rope_factor, cfg.rope_theta) == (kind, SCALED_ROPE[kind]["factor"], 500000.0)
    if kind == "llama3":
        assert (cfg.rope_low_freq_factor, cfg.rope_high_freq_factor, cfg.rope_original_max_len) == (1.0, 4.0, 64)
    tokens = np.random.default_rng(1).integers(0, cfg.vocab_size, 100).tolist()
    want = hf_logits(model, tokens)
    ours = load_model(cfg)
    assert_logits_close(dense(ours, tokens), want, f"{kind} dense forward")
    assert_logits_close(dense(ours.fused(), tokens), want, f"{kind} dense forward, fused layout")
    # the oracle sees the scaling: plain RoPE on the same weights is far off
    for layer in ours.layers:
        layer.rope_scaling = None
    assert np.abs(dense(ours, tokens) - want).max() > 1e-2
    assert_cb_equals_generate(model, cfg, f"{kind} rope")
    # the older config.json form: `rope_scaling` (its kind under "type") and a top-level rope_theta
    legacy = {k: v for k, v in SCALED_ROPE[kind].items() if k != "rope_type"}
    _edit_config(tmp_path, rope_parameters=None, rope_scaling={"type": kind, **legacy}, rope_theta=500000.0)
    assert load_config(ModelConfig(name="hf", path=str(tmp_path), dtype="auto", max_model_len=MAX_MODEL_LEN)) == cfg


def test_sharded_and_bf16_checkpoints_load(tmp_path, checkpoint):
    model = build_hf("qwen2", tmp_path / "sharded")
    model.save_pretrained(str(tmp_path / "sharded"), max_shard_size="40KB")
    (tmp_path / "sharded" / "model.safetensors").unlink()  # the first save's single file: shards only
    assert (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    _, _, cfg = checkpoint("qwen2")
    sharded = ModelConfig(path=str(tmp_path / "sharded"), dtype="auto", max_model_len=MAX_MODEL_LEN)
    a, b = nnx.state(load_model(cfg)), nnx.state(load_model(sharded))
    assert jax.tree.structure(a) == jax.tree.structure(b)
    assert all(np.array_equal(x, y) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))

    build_hf("llama", tmp_path / "bf16", dtype=torch.bfloat16)
    cfg16 = load_config(ModelConfig(path=str(tmp_path / "bf16"), dtype="auto", max_model_len=0))
    assert cfg16.dtype == "bfloat16"
    assert {x.dtype for x in jax.tree.leaves(nnx.state(load_model(cfg16)))} == {jnp.dtype(jnp.bfloat16)}
    as32 = load_config(ModelConfig(path=str(tmp_path / "bf16"), dtype="float32", max_model_len=0))
    assert {x.dtype for x in jax.tree.leaves(nnx.state(load_model(as32)))} == {jnp.dtype(jnp.float32)}


def test_mistral_loads_with_context_capped_by_its_sliding_window(tmp_path):
    config = transformers.MistralConfig(**COMMON, num_attention_heads=4, num_key_value_heads=2, sliding_window=96)
    model = transformers.MistralForCausalLM(config).eval()
    model.save_pretrained(str(tmp_path))
    cfg = load_config(ModelConfig(path=str(tmp_path), dtype="auto", max_model_len=0))
    assert cfg.max_model_len == 96 and not cfg.attention_bias
    tokens = list(range(3, 40))
    assert_logits_close(dense(load_model(cfg), tokens), hf_logits(model, tokens), "mistral dense forward")
    with pytest.raises(ValueError, match="exceeds the checkpoint's sliding_window 96"):
        load_config(ModelConfig(path=str(tmp_path), dtype="auto", max_model_len=128))


def _edit_config(model_dir, **changes):
    path = model_dir / "config.json"
    cfg = json.loads(path.read_text())
    cfg.update(changes)
    path.write_text(json.dumps(cfg))


def test_loader_errors_name_the_problem(tmp_path):
    from safetensors.numpy import load_file, save_file

    build_hf("llama", tmp_path)
    load = lambda: load_model(ModelConfig(path=str(tmp_path), dtype="auto", max_model_len=0))  # noqa: E731

    _edit_config(tmp_path, model_type="gpt2", architectures=["GPT2LMHeadModel"])
    with pytest.raises(ValueError, match="unsupported architecture model_type='gpt2'"):
        load()
    _edit_config(tmp_path, model_type="llama", architectures=["LlamaForCausalLM"],
                 rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0})  # fmt: skip
    with pytest.raises(ValueError, match="unsupported rope scaling type 'yarn'"):
        load()
    _edit_config(tmp_path, rope_parameters={"rope_type": "default", "rope_theta": 1e4}, head_dim=23)
    with pytest.raises(ValueError, match="model.head_dim must be even for RoPE, got 23"):
        load()
    _edit_config(tmp_path, head_dim=24, intermediate_size=96)
    with pytest.raises(ValueError, match=r"tensor 'model.layers.0.mlp.gate_proj.weight' has shape \[128, 64\]"):
        load()
    _edit_config(tmp_path, intermediate_size=128)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    del tensors["model.layers.1.self_attn.k_proj.bias"]
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="tensor 'model.layers.1.self_attn.k_proj.bias' is missing"):
        load()
    with pytest.raises(ValueError, match="is not a directory"):
        load_config(ModelConfig(path=str(tmp_path / "nope"), dtype="auto"))
    (tmp_path / "config.json").unlink()
    with pytest.raises(ValueError, match="no config.json"):
        load()


# ---- tokenizer and text prompts ----
WORDS = ["the", "cat", "sat", "on", "a", "mat", "dog", "ran", "far", "away", "and", "then", "slept"]


def build_tokenizer(model_dir):
    """A word-level tokenizer whose encode adds <s> in front, as Llama's does."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{w: i + 3 for i, w in enumerate(WORDS)}}
    vocab.update({f"w{i}": i for i in range(len(vocab), COMMON["vocab_size"])})  # every model id decodes
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    tok.add_special_tokens(["<unk>", "<s>", "</s>"])
    tok.save(str(model_dir / "tokenizer.json"))


def test_tokenizer_encodes_as_transformers_fast_tokenizer(tmp_path):
    build_tokenizer(tmp_path)
    ours = load_tokenizer(tmp_path)
    theirs = transformers.PreTrainedTokenizerFast(tokenizer_file=str(tmp_path / "tokenizer.json"))
    text = "the cat sat on a mat and then slept"
    assert ours.encode(text) == theirs(text)["input_ids"] == [1, 3, 4, 5, 6, 7, 8, 13, 14, 15]
    assert ours.decode(ours.encode(text)) == text
    assert load_tokenizer(tmp_path / "missing") is None and load_tokenizer(None) is None


def test_jsonl_prompt_text_is_read_and_checked(tmp_path):
    trace = tmp_path / "t.jsonl"
    lines = [
        {"arrival_s": 0.0, "prompt": "the cat sat", "max_tokens": 4},
        {"arrival_s": 0.0, "prompt": "the cat", "prompt_len": 2, "max_tokens": 4},
        {"arrival_s": 0.0, "prompt": 7, "max_tokens": 4},
    ]
    trace.write_text("".join(json.dumps(x) + "\n" for x in lines))
    ok, both, bad = load_trace(WorkloadConfig(name="trace", path=str(trace)), seed=0)
    assert ok.prompt_text == "the cat sat" and ok.input_error is None and ok.synthetic_prompt is None
    assert "prompt (text) excludes prompt_token_ids and prompt_len" in both.input_error
    assert "prompt 7 is not a string" in bad.input_error
    build_tokenizer(tmp_path)
    encode_text_prompts([ok, both], load_tokenizer(tmp_path))
    assert ok.prompt_token_ids == [1, 3, 4, 5] and ok.prompt_len == 4 and both.prompt_token_ids is None


def test_text_prompts_without_a_tokenizer_are_rejected_by_name():
    reqs = [Request("7", 0.0, 0, prompt_text="the cat")]
    encode_text_prompts(reqs, None, where="model 'tiny'")
    assert "request 7: prompt is text, but model 'tiny' has no tokenizer" in reqs[0].input_error


def test_jsonl_text_workload_runs_end_to_end_with_output_text(tmp_path, checkpoint):
    """run_single with model.path: the same ModelConfig as above, so compiled steps are reused."""
    model, model_dir, _ = checkpoint("llama")
    build_tokenizer(Path(model_dir))
    texts = ["the cat sat on a mat", "a dog ran far away", "then the dog slept", "the mat"]
    trace = tmp_path / "w.jsonl"
    trace.write_text("".join(json.dumps({"arrival_s": 0.0, "prompt": t, "max_tokens": 6}) + "\n" for t in texts))
    run_cfg = RunConfig(
        model=ModelConfig(name="hf", path=model_dir, dtype="auto", max_model_len=MAX_MODEL_LEN),
        executor=ExecutorConfig(name="jax", token_buckets=BUCKETS),
        scheduler=SchedulerConfig(max_num_seqs=NUM_SLOTS, max_num_batched_tokens=BUDGET),
        cache=CacheConfig(num_pages=NUM_PAGES, page_size=PAGE_SIZE),
        workload=WorkloadConfig(name="trace", path=str(trace)),
        progress=False,
    )
    summary = run_single(run_cfg, tmp_path / "out", verbose=False)
    assert summary["num_finished"] == len(texts)
    tok = load_tokenizer(model_dir)
    rows = [json.loads(line) for line in (tmp_path / "out" / "requests.jsonl").read_text().splitlines()]
    prompts = [tok.encode(text) for text in texts]
    want = hf_greedy(model, prompts, [6] * len(prompts), eos_token_id=2)
    for row, prompt, expected in zip(rows, prompts, want):
        assert row["prompt_len"] == len(prompt) and prompt[0] == 1  # <s> added
        assert row["output_token_ids"] == expected
        words = [WORDS[i - 3] if i < 3 + len(WORDS) else f"w{i}" for i in expected if i > 2]
        assert row["output_text"] == " ".join(words)
    assert json.loads((tmp_path / "out" / "summary.json").read_text())["compiles_after_warmup"] == 0
