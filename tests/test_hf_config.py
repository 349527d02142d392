"""config.json keys against transformers: each one cbjax reads resolves as transformers resolves
it, or the load fails naming the key. Tiny random checkpoints built with transformers (no
downloads); transformers is the oracle."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from cbjax.config import ModelConfig  # noqa: E402
from cbjax.model.hf import load_model  # noqa: E402
from test_hf import assert_logits_close, build_hf, dense, hf_logits  # noqa: E402

TOKENS = np.random.default_rng(4).integers(0, 512, 60).tolist()


def test_rope_fields_set_beside_model_path_give_way_to_config_json(tmp_path):
    """A preset's or the command line's model.rope_* never reach a checkpoint whose config.json
    asks for plain RoPE: the logits are transformers'."""
    model = build_hf("llama", tmp_path, seed=11)
    stale = ModelConfig(path=str(tmp_path), dtype="auto", max_model_len=0, rope_type="linear", rope_factor=4.0)
    assert_logits_close(dense(load_model(stale), TOKENS), hf_logits(model, TOKENS), "plain RoPE checkpoint")
