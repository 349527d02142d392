"""A broken checkpoint fails in one line naming the file and the key (no transformers needed)."""

import json

import numpy as np
import pytest
from safetensors.numpy import save_file

from cbjax.config import ModelConfig
from cbjax.model.hf import load_config, load_model

CONFIG = {
    "model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 32, "hidden_size": 16,
    "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1, "intermediate_size": 32,
    "max_position_embeddings": 64, "torch_dtype": "float32", "tie_word_embeddings": True,
}  # fmt: skip


def tiny_checkpoint(model_dir, **config_changes):
    """A complete one-layer Llama checkpoint (random weights) written by hand."""
    model_dir.mkdir(parents=True, exist_ok=True)
    config = {**CONFIG, **config_changes}
    (model_dir / "config.json").write_text(json.dumps(config))
    d, ffn, kv, p = 16, 32, 8, "model.layers.0"
    shapes = {
        "model.embed_tokens.weight": (32, d), "model.norm.weight": (d,),
        f"{p}.input_layernorm.weight": (d,), f"{p}.post_attention_layernorm.weight": (d,),
        f"{p}.self_attn.q_proj.weight": (d, d), f"{p}.self_attn.k_proj.weight": (kv, d),
        f"{p}.self_attn.v_proj.weight": (kv, d), f"{p}.self_attn.o_proj.weight": (d, d),
        f"{p}.mlp.gate_proj.weight": (ffn, d), f"{p}.mlp.up_proj.weight": (ffn, d), f"{p}.mlp.down_proj.weight": (d, ffn),
    }  # fmt: skip
    rng = np.random.default_rng(0)
    save_file({k: rng.standard_normal(s).astype(np.float32) for k, s in shapes.items()}, str(model_dir / "model.safetensors"))
    return model_dir


def load(model_dir):
    return load_model(ModelConfig(path=str(model_dir), dtype="auto", max_model_len=0))


def one_line(err) -> str:
    text = str(err.value)
    assert "\n" not in text
    return text


def test_the_hand_written_checkpoint_loads(tmp_path):
    from safetensors.numpy import load_file

    model_dir = tiny_checkpoint(tmp_path / "ok")
    model = load(model_dir)
    want = load_file(str(model_dir / "model.safetensors"))["model.embed_tokens.weight"]
    np.testing.assert_array_equal(np.asarray(model.embed_tokens.get_value()), want)


@pytest.mark.parametrize("key", ["hidden_size", "vocab_size", "num_hidden_layers", "num_attention_heads", "intermediate_size"])
def test_a_config_missing_a_key_names_the_file_and_the_key(tmp_path, key):
    model_dir = tiny_checkpoint(tmp_path)
    config = json.loads((model_dir / "config.json").read_text())
    del config[key]
    (model_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError) as err:
        load_config(ModelConfig(path=str(model_dir), dtype="auto", max_model_len=0))
    assert f"{model_dir / 'config.json'} has no '{key}'" in one_line(err)


def test_a_key_of_the_wrong_type_names_it(tmp_path):
    model_dir = tiny_checkpoint(tmp_path, hidden_size="16")
    with pytest.raises(ValueError) as err:
        load(model_dir)
    assert "'hidden_size' must be a positive integer, got '16'" in one_line(err)


@pytest.mark.parametrize("keep", [4, 100, -64])  # inside the length prefix, inside the header, inside the data
def test_a_truncated_safetensors_file_names_the_file(tmp_path, keep):
    model_dir = tiny_checkpoint(tmp_path)
    file = model_dir / "model.safetensors"
    data = file.read_bytes()
    file.write_bytes(data[:keep])
    with pytest.raises(ValueError) as err:
        load(model_dir)
    line = one_line(err)
    assert str(file) in line and "truncated" in line


def test_a_quantized_checkpoint_is_refused_naming_quantization_config(tmp_path):
    """Quantized weights (their scales beside them) are not float weights to cast: refused at
    load_config, which the simulator's memory sizing also reads, naming the key."""
    model_dir = tiny_checkpoint(tmp_path, quantization_config={"quant_method": "fp8", "weight_block_size": [128, 128]})
    with pytest.raises(ValueError) as err:
        load_config(ModelConfig(path=str(model_dir), dtype="auto", max_model_len=0))
    assert "quantization_config" in one_line(err) and "'fp8'" in str(err.value)


def test_a_shard_index_naming_the_wrong_shard_names_the_index_and_the_tensor(tmp_path):
    from safetensors.numpy import load_file

    model_dir = tiny_checkpoint(tmp_path)
    tensors = load_file(str(model_dir / "model.safetensors"))
    (model_dir / "model.safetensors").unlink()
    save_file({"model.norm.weight": tensors.pop("model.norm.weight")}, str(model_dir / "b.safetensors"))
    save_file(tensors, str(model_dir / "a.safetensors"))
    weight_map = {name: "a.safetensors" for name in tensors} | {"model.norm.weight": "a.safetensors"}
    (model_dir / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(ValueError) as err:
        load(model_dir)
    line = one_line(err)
    assert "model.safetensors.index.json" in line and "'model.norm.weight'" in line and "a.safetensors" in line
