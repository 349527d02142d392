"""config.json keys against transformers: each one cbjax reads resolves as transformers resolves
it, or the load fails naming the key. Tiny random checkpoints built with transformers (no
downloads); transformers is the oracle."""

from __future__ import annotations

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from cbjax.config import ModelConfig  # noqa: E402
from cbjax.model.hf import load_config, load_model  # noqa: E402
from test_hf import assert_logits_close, build_hf, dense, hf_logits  # noqa: E402

TOKENS = np.random.default_rng(4).integers(0, 512, 60).tolist()


def test_rope_fields_set_beside_model_path_give_way_to_config_json(tmp_path):
    """A preset's or the command line's model.rope_* never reach a checkpoint whose config.json
    asks for plain RoPE: the logits are transformers'."""
    model = build_hf("llama", tmp_path, seed=11)
    stale = ModelConfig(path=str(tmp_path), dtype="auto", max_model_len=0, rope_type="linear", rope_factor=4.0)
    assert_logits_close(dense(load_model(stale), TOKENS), hf_logits(model, TOKENS), "plain RoPE checkpoint")


def _drop_config_keys(model_dir, *keys):
    path = model_dir / "config.json"
    config = json.loads(path.read_text())
    for key in keys:
        del config[key]
    path.write_text(json.dumps(config))


# (transformers config class, causal-LM class, config keys): sliding-window attention on every layer
SLIDING = {
    "mistral": ("MistralConfig", "MistralForCausalLM", {}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {"use_sliding_window": True, "max_window_layers": 0}),
}


@pytest.mark.parametrize("arch", list(SLIDING))
def test_a_config_json_without_sliding_window_gets_transformers_default_window(tmp_path, arch):
    """config.json omits sliding_window: transformers attends through its class default window,
    so the context cbjax serves exactly stops at that window."""
    config_cls, model_cls, kw = SLIDING[arch]
    config = getattr(transformers, config_cls)(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=8192, **kw,
    )  # fmt: skip
    getattr(transformers, model_cls)(config).save_pretrained(str(tmp_path))
    _drop_config_keys(tmp_path, "sliding_window")
    window = transformers.AutoConfig.from_pretrained(str(tmp_path)).sliding_window
    assert window is not None and window < 8192
    cfg = load_config(ModelConfig(path=str(tmp_path), dtype="auto", max_model_len=0))
    assert cfg.max_model_len <= window
    with pytest.raises(ValueError, match=f"exceeds the checkpoint's sliding_window {window}"):
        load_config(ModelConfig(path=str(tmp_path), dtype="auto", max_model_len=window + 1))


def test_a_tied_checkpoint_that_stores_its_own_lm_head(tmp_path):
    """tie_word_embeddings true, and the checkpoint also holds lm_head.weight: a copy of the
    embeddings loads tied; a head of its own (which transformers keeps untied) is refused
    naming the key, never silently replaced by the embeddings."""
    from safetensors.numpy import load_file, save_file

    build_hf("qwen2", tmp_path, seed=13)  # tied
    file = str(tmp_path / "model.safetensors")
    tensors = load_file(file)
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].copy()
    save_file(tensors, file, metadata={"format": "pt"})
    theirs = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path)).eval()
    cfg = ModelConfig(path=str(tmp_path), dtype="auto", max_model_len=0)
    assert_logits_close(dense(load_model(cfg), TOKENS), hf_logits(theirs, TOKENS), "tied, head stored as a copy")

    tensors["lm_head.weight"] = np.random.default_rng(0).normal(0.0, 0.1, tensors["lm_head.weight"].shape).astype(np.float32)
    save_file(tensors, file, metadata={"format": "pt"})
    with pytest.raises(ValueError, match="'lm_head.weight' differs from 'model.embed_tokens.weight'.*tie_word_embeddings"):
        load_model(cfg)


def test_a_directory_with_one_file_and_shards_loads_what_transformers_loads(tmp_path):
    """save_pretrained with shards into a directory holding an earlier single-file save leaves
    both model.safetensors and the shard index; the weights served are the ones transformers
    loads from that directory."""
    build_hf("llama", tmp_path, seed=0)
    resaved = build_hf("llama", tmp_path / "other", seed=1)
    resaved.save_pretrained(str(tmp_path), max_shard_size="40KB")
    assert (tmp_path / "model.safetensors").is_file() and (tmp_path / "model.safetensors.index.json").is_file()
    theirs = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path)).eval()
    ours = load_model(ModelConfig(path=str(tmp_path), dtype="auto", max_model_len=0))
    assert_logits_close(dense(ours, TOKENS), hf_logits(theirs, TOKENS), "single file beside shards")
