"""Load a local Hugging Face Llama, Mistral or Qwen2 checkpoint (config.json + safetensors) into cbjax.

`load_config` fills a ModelConfig's architecture fields from `config.json`; `load_model`
reads the `*.safetensors` files (`model.safetensors`, else shards listed in `model.safetensors.index.json`)
into an abstract `cbjax.model.llama.Llama` through `name_map` (Hugging Face tensor name ->
module path), transposing each nn.Linear weight from Hugging Face's [out, in] to [in, out]
and reshaping it to the module's head-split layout. Nothing is ever downloaded: `model.path` is a directory on disk.

Two ModelConfig values mean "take it from the checkpoint": `dtype="auto"` (config.json's
dtype; float16 loads as float32, which holds it exactly) and `max_model_len=0`
(max_position_embeddings, capped by a sliding window so attention stays exact).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, NamedTuple, Union

import jax
import jax.numpy as jnp
import ml_dtypes  # noqa: F401  registers bfloat16 with numpy, so safetensors can read BF16 tensors
import numpy as np
from flax import nnx

from cbjax.config import ModelConfig
from cbjax.model.llama import Llama, check_supported

# model_type -> the causal-LM class whose weights we read
ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM"}
ROPE_TYPES = ("default", "linear", "llama3")
_DTYPES = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float32"}
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
# transformers' sliding_window for a Mistral (or a Qwen2 with use_sliding_window) config.json without one
DEFAULT_SLIDING_WINDOW = 4096
# Buffers some older checkpoints carry; recomputed here, never read.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
# config.json keys with no default: the model's shape
REQUIRED_KEYS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size")


def read_hf_config(model_dir: str | Path) -> dict[str, Any]:
    """config.json of `model_dir` as a dict, after checking the directory holds one."""
    path = Path(model_dir)
    if not path.is_dir():
        raise ValueError(f"model.path {str(model_dir)!r} is not a directory (resolved to {path.resolve()})")
    config_file = path / "config.json"
    if not config_file.is_file():
        raise ValueError(f"model.path {str(model_dir)!r}: no config.json in {path.resolve()}")
    try:
        return json.loads(config_file.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"model.path {str(model_dir)!r}: cannot read config.json: {e}") from e


def load_config(cfg: ModelConfig) -> ModelConfig:
    """`cfg` with every architecture field taken from `cfg.path`/config.json.

    Kept from `cfg`: name, path, an explicit dtype, and an explicit max_model_len (which must
    fit the checkpoint's context).
    """
    if not cfg.path:
        raise ValueError("model.path is not set: load_config needs a Hugging Face model directory")
    hf = read_hf_config(cfg.path)
    where = f"model.path {cfg.path!r}"
    model_type = hf.get("model_type")
    if model_type not in ARCHITECTURES:
        raise ValueError(
            f"{where}: unsupported architecture model_type={model_type!r} "
            f"(architectures {hf.get('architectures')}); supported: {', '.join(ARCHITECTURES)}"
        )
    expected_arch = ARCHITECTURES[model_type]
    archs = hf.get("architectures") or [expected_arch]
    if expected_arch not in archs:
        raise ValueError(f"{where}: unsupported architecture {archs}; for {model_type!r} cbjax reads {expected_arch}")
    quantization = hf.get("quantization_config")
    if quantization:
        method = quantization.get("quant_method") if isinstance(quantization, dict) else quantization
        raise ValueError(f"{where}: config.json's quantization_config (quant_method {method!r}) is not supported; "
                         "cbjax loads unquantized float32, bfloat16 or float16 weights")  # fmt: skip
    if hf.get("hidden_act", "silu") != "silu":
        raise ValueError(f"{where}: unsupported hidden_act {hf['hidden_act']!r}; cbjax's MLP is SwiGLU (silu)")
    rope_theta, rope_knobs = _rope(hf, where)
    required = {key: _required(hf, key, cfg.path) for key in REQUIRED_KEYS}

    num_heads = required["num_attention_heads"]
    limit, limit_key = hf.get("max_position_embeddings", 2048), "max_position_embeddings"
    window = _sliding_window(hf, model_type)
    if window is not None and window < limit:
        limit, limit_key = window, "sliding_window"
    max_model_len = cfg.max_model_len or limit
    if max_model_len > limit:
        raise ValueError(
            f"model.max_model_len {max_model_len} exceeds the checkpoint's {limit_key} {limit} ({where})"
        )
    qkv_bias, o_bias, mlp_bias = _biases(hf, model_type)
    eos_ids = _eos_token_ids(hf, Path(cfg.path))
    dtype = cfg.dtype
    if dtype == "auto":
        hf_dtype = hf.get("dtype") or hf.get("torch_dtype") or "float32"
        if hf_dtype not in _DTYPES:
            raise ValueError(f"{where}: unsupported dtype {hf_dtype!r}; set model.dtype to float32 or bfloat16")
        dtype = _DTYPES[hf_dtype]
    resolved = dataclasses.replace(
        cfg,
        vocab_size=required["vocab_size"],
        d_model=required["hidden_size"],
        num_layers=required["num_hidden_layers"],
        num_heads=num_heads,
        num_kv_heads=hf.get("num_key_value_heads") or num_heads,
        head_dim=hf.get("head_dim") or required["hidden_size"] // num_heads,
        ffn_dim=required["intermediate_size"],
        rope_theta=float(rope_theta),
        **rope_knobs,
        max_model_len=max_model_len,
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        dtype=dtype,
        mlp="gated",
        attention_bias=qkv_bias,
        o_proj_bias=o_bias,
        mlp_bias=mlp_bias,
        norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        eos_token_id=eos_ids[0] if eos_ids else None,
        extra_eos_token_ids=eos_ids[1:],
    )
    check_supported(resolved)
    return resolved


def _required(hf: dict[str, Any], key: str, model_dir: str) -> int:
    """config.json's `key`, a positive integer; a ValueError naming the file and the key otherwise."""
    config_file = Path(model_dir) / "config.json"
    if key not in hf:
        raise ValueError(f"model.path {model_dir!r}: {config_file} has no {key!r}")
    value = hf[key]
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"model.path {model_dir!r}: {config_file}: {key!r} must be a positive integer, got {value!r}")
    return value


class HFTensor(NamedTuple):
    """Where one checkpoint tensor goes: its shape as stored, and the module path it fills."""

    shape: tuple[int, ...]
    transpose: bool  # an nn.Linear weight: [out, in] in the checkpoint, [in, out] in the module
    path: tuple[Union[str, int], ...]  # attribute names and layer indices from the Llama


def name_map(cfg: ModelConfig) -> dict[str, HFTensor]:
    """Every tensor the checkpoint must hold, in the (unfused) `Llama` built from `cfg`."""
    d, q_dim, kv_dim, ffn = cfg.d_model, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.ffn_dim
    out = {"model.embed_tokens.weight": HFTensor((cfg.vocab_size, d), False, ("embed_tokens",))}

    def linear(name: str, path: tuple, d_in: int, d_out: int, bias: bool) -> None:
        out[f"{name}.weight"] = HFTensor((d_out, d_in), True, (*path, "kernel"))
        if bias:
            out[f"{name}.bias"] = HFTensor((d_out,), False, (*path, "bias"))

    for i in range(cfg.num_layers):
        p, layer = f"model.layers.{i}", ("layers", i)
        for norm in ("input_layernorm", "post_attention_layernorm"):
            out[f"{p}.{norm}.weight"] = HFTensor((d,), False, (*layer, norm, "scale"))
        linear(f"{p}.self_attn.q_proj", (*layer, "q_proj"), d, q_dim, cfg.attention_bias)
        linear(f"{p}.self_attn.k_proj", (*layer, "k_proj"), d, kv_dim, cfg.attention_bias)
        linear(f"{p}.self_attn.v_proj", (*layer, "v_proj"), d, kv_dim, cfg.attention_bias)
        linear(f"{p}.self_attn.o_proj", (*layer, "o_proj"), q_dim, d, cfg.o_proj_bias)
        linear(f"{p}.mlp.gate_proj", (*layer, "gate_proj"), d, ffn, cfg.mlp_bias)
        linear(f"{p}.mlp.up_proj", (*layer, "up_proj"), d, ffn, cfg.mlp_bias)
        linear(f"{p}.mlp.down_proj", (*layer, "down_proj"), ffn, d, cfg.mlp_bias)
    out["model.norm.weight"] = HFTensor((d,), False, ("norm", "scale"))
    if not cfg.tie_embeddings:
        out["lm_head.weight"] = HFTensor((cfg.vocab_size, d), True, ("lm_head",))
    return out


def load_model(cfg: ModelConfig) -> Llama:
    """The checkpoint as an unfused `Llama` in the resolved dtype (`.fused()` for serving).

    Raises ValueError naming the tensor for a missing tensor, an unexpected one (an
    architecture variant cbjax does not model) or a shape that disagrees with config.json.
    """
    cfg = load_config(cfg)
    model_dir = Path(cfg.path)
    where = f"model.path {cfg.path!r}"
    expected = name_map(cfg)
    files = _tensor_files(model_dir, where)
    missing = [name for name in expected if name not in files]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise ValueError(f"{where}: tensor {missing[0]!r} is missing from the checkpoint{more}")
    unexpected = [
        name for name in files
        if name not in expected and not name.endswith(_IGNORED_SUFFIXES)
        and not (name == "lm_head.weight" and cfg.tie_embeddings)
    ]  # fmt: skip
    if unexpected:
        raise ValueError(
            f"{where}: unexpected tensor {unexpected[0]!r} ({len(unexpected)} in all): an architecture "
            f"variant cbjax does not support"
        )
    if cfg.tie_embeddings and "lm_head.weight" in files:
        _check_tied_head(files, where)
    dtype = jnp.dtype(cfg.dtype)
    model = nnx.eval_shape(lambda: Llama(cfg, seed=None))  # shapes only; every Param is filled below
    by_file: dict[Path, list[str]] = {}
    for name in expected:
        by_file.setdefault(files[name], []).append(name)
    for file, names in by_file.items():
        with _open_safetensors(file, where) as f:
            held = set(f.keys())
            for name in names:
                if name not in held:  # only a shard index can name a file that lacks the tensor
                    raise ValueError(f"{where}: {INDEX_FILE} lists tensor {name!r} in {file.name}, which does not hold it")
                tensor = expected[name]
                got = tuple(f.get_slice(name).get_shape())
                if got != tensor.shape:
                    raise ValueError(
                        f"{where}: tensor {name!r} has shape {list(got)}, config.json implies {list(tensor.shape)}"
                    )
                try:
                    array = f.get_tensor(name)
                except Exception as e:  # safetensors' Rust error: the file ends before the tensor does
                    raise ValueError(f"{where}: {file}: cannot read tensor {name!r} ({e}); a truncated file?") from e
                array = array.T if tensor.transpose else array
                variable = _module_variable(model, tensor.path)
                # device_put, not jnp.asarray: no compiled copy program per shape
                variable.set_value(jax.device_put(np.ascontiguousarray(array.astype(dtype)).reshape(variable.shape)))
    unfilled = [path for path, node in nnx.iter_graph(model)
                if isinstance(node, nnx.Param) and isinstance(node.get_value(), jax.ShapeDtypeStruct)]  # fmt: skip
    if unfilled:  # name_map and Llama disagree: a bug here, not in the checkpoint
        raise RuntimeError(f"load_model: name_map left {unfilled[0]} unfilled")
    return model


def _check_tied_head(files: dict[str, Path], where: str) -> None:
    """A tied checkpoint may store its LM head as a copy of the embeddings. A head of its own is
    refused: tying would put the embeddings in its place, where transformers keeps the stored head."""
    with _open_safetensors(files["lm_head.weight"], where) as f:
        head = f.get_tensor("lm_head.weight")
    with _open_safetensors(files["model.embed_tokens.weight"], where) as f:
        embed = f.get_tensor("model.embed_tokens.weight")
    if not np.array_equal(head, embed):
        raise ValueError(
            f"{where}: the checkpoint's 'lm_head.weight' differs from 'model.embed_tokens.weight', which "
            f"config.json's tie_word_embeddings true would use in its place; set tie_word_embeddings to false"
        )


def _module_variable(model: Llama, path: tuple[Union[str, int], ...]) -> nnx.Param:
    node: Any = model
    for key in path:
        node = node[key] if isinstance(key, int) else getattr(node, key)
    return node


def _rope(hf: dict[str, Any], where: str) -> tuple[float, dict[str, Any]]:
    """(rope_theta, the ModelConfig rope_* fields of its scaling) from the v5 `rope_parameters`
    or the older `rope_scaling` and top-level `rope_theta`."""
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ROPE_TYPES:
        raise ValueError(f"{where}: unsupported rope scaling type {rope_type!r}; supported: {', '.join(ROPE_TYPES)}")
    partial = hf.get("partial_rotary_factor", rope.get("partial_rotary_factor", 1.0))
    if partial != 1.0:
        raise ValueError(f"{where}: unsupported partial_rotary_factor {partial}; cbjax rotates the whole head")
    theta = rope.get("rope_theta", hf.get("rope_theta", 10000.0))
    # every rope_* field, so none set beside model.path (a preset's, the command line's) survives
    fields = ModelConfig.__dataclass_fields__
    knobs = {name: fields[name].default for name in fields if name.startswith("rope_") and name != "rope_theta"}
    if rope_type == "default":
        return theta, knobs
    if "factor" not in rope:
        raise ValueError(f"{where}: rope scaling {rope_type!r} has no 'factor'")
    knobs.update(rope_type=rope_type, rope_factor=float(rope["factor"]))
    if rope_type == "llama3":
        knobs.update(
            rope_low_freq_factor=float(rope.get("low_freq_factor", 1.0)),
            rope_high_freq_factor=float(rope.get("high_freq_factor", 4.0)),
            rope_original_max_len=int(rope.get("original_max_position_embeddings") or hf.get("max_position_embeddings", 8192)),
        )
    return theta, knobs


def _sliding_window(hf: dict[str, Any], model_type: str):
    """The attention window config.json sets (None: none); where the key is absent, the class
    default transformers' MistralConfig and Qwen2Config apply."""
    if model_type == "qwen2" and not hf.get("use_sliding_window", False):
        return None
    if model_type in ("mistral", "qwen2"):
        return hf.get("sliding_window", DEFAULT_SLIDING_WINDOW)
    return hf.get("sliding_window")


def _biases(hf: dict[str, Any], model_type: str) -> tuple[bool, bool, bool]:
    """(q/k/v bias, o_proj bias, mlp bias) as each architecture defines them."""
    if model_type == "qwen2":
        return True, False, False
    if model_type == "llama":
        attn = bool(hf.get("attention_bias", False))
        return attn, attn, bool(hf.get("mlp_bias", False))
    return False, False, False


def _eos_token_ids(hf: dict[str, Any], model_dir: Path) -> list[int]:
    """generation_config.json's eos ids (what `generate` stops on), else config.json's."""
    eos = hf.get("eos_token_id")
    gen_file = model_dir / "generation_config.json"
    if gen_file.is_file():
        try:
            eos = json.loads(gen_file.read_text()).get("eos_token_id", eos)
        except json.JSONDecodeError:
            pass
    if eos is None:
        return []
    return list(dict.fromkeys(eos)) if isinstance(eos, list) else [eos]


def _tensor_files(model_dir: Path, where: str) -> dict[str, Path]:
    """Tensor name -> the safetensors file holding it: model.safetensors alone where it exists
    (transformers reads it before any shard index, so a sharded re-save into the directory of
    a single-file save does not change what it loads), else the shard index, else every
    *.safetensors file's header."""
    single = model_dir / SINGLE_FILE
    if single.is_file():
        with _open_safetensors(single, where) as f:
            return {name: single for name in f.keys()}
    index = model_dir / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, json.JSONDecodeError, KeyError) as e:
            raise ValueError(f"{where}: cannot read {INDEX_FILE}: {e}") from e
        files = {name: model_dir / shard for name, shard in weight_map.items()}
        absent = sorted({str(f.name) for f in files.values() if not f.is_file()})
        if absent:
            raise ValueError(f"{where}: shard {absent[0]!r} listed in {INDEX_FILE} does not exist")
        return files
    shards = sorted(model_dir.glob("*.safetensors"))
    if not shards:
        raise ValueError(f"{where}: no *.safetensors files in {model_dir.resolve()}")
    files = {}
    for shard in shards:
        with _open_safetensors(shard, where) as f:
            for name in f.keys():
                files[name] = shard
    return files


def _open_safetensors(file: Path, where: str):
    """`safe_open(file)`; a ValueError naming the file when its header is unreadable or names
    data past the file's end (a truncated or corrupt copy)."""
    from safetensors import safe_open

    try:
        return safe_open(str(file), framework="numpy")
    except Exception as e:  # safetensors raises its own Rust-side error type
        raise ValueError(f"{where}: {file} is not a readable safetensors file ({e}); a truncated or corrupt copy?") from e
