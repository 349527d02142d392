"""Greedy parity of speculative decoding at SmolLM-135M's shape (random weights): with n-gram
drafts, the target's first layers (`spec.draft_layers`) and a separate draft model, at k = 1, 3
and 5, every request's tokens equal those without speculation, drafts are both accepted and
rejected, and nothing compiles after warmup (slow: a real-sized model on the CPU)."""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path

import numpy as np
import pytest
import yaml
from flax import nnx

from cbjax.config import CacheConfig, ExecutorConfig, ModelConfig, SchedulerConfig, SpecConfig
from cbjax.core.request import FinishReason, Request, SamplingParams
from cbjax.engine.offline import serve
from cbjax.model.llama import Llama
from cbjax.runtime.executor import JaxExecutor
from cbjax.scheduler import Scheduler

CONFIGS = Path(__file__).resolve().parents[1] / "configs" / "model"
SMOLLM = ModelConfig(**yaml.safe_load((CONFIGS / "smollm_135m.yaml").read_text()))
DRAFT_LAYERS = 15  # half the target's: with the prompts below, some drafts agree and some not
DRAFT = dataclasses.replace(SMOLLM, name="smollm_135m_first_layers", num_layers=DRAFT_LAYERS)
SCHED = SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=64)
CACHE = CacheConfig(num_pages=40, page_size=16, prefix_caching=False)
BUCKETS = [16, 64]
OUTPUTS = 40


@functools.lru_cache(maxsize=None)
def target() -> Llama:
    return Llama(SMOLLM, seed=0)


def first_layers_of(model: Llama) -> Llama:
    """A separate draft model (its own weights and KV pool) holding the target's first
    DRAFT_LAYERS layers, embeddings and final norm (tied head)."""
    draft = Llama(DRAFT, seed=1)
    for i in range(DRAFT_LAYERS):
        nnx.update(draft.layers[i], nnx.state(model.layers[i]))
    nnx.update(draft.norm, nnx.state(model.norm))
    draft.embed_tokens.set_value(model.embed_tokens.get_value())
    return draft


def requests() -> list[Request]:
    # random prompts, as benchmarks/spec_speed.py draws them: random weights under greedy
    # decoding fall into loops, so later outputs repeat earlier ones and n-gram drafts hit
    rng = np.random.default_rng(0)
    return [
        Request(str(i), 0.0, 32, prompt_token_ids=rng.integers(0, SMOLLM.vocab_size, 32).tolist(),
                sampling=SamplingParams(max_tokens=OUTPUTS, ignore_eos=True))
        for i in range(2)
    ]  # fmt: skip


def run(spec: SpecConfig) -> tuple[dict, int, int]:
    separate = spec.draft_model is not None
    ex = JaxExecutor(
        SMOLLM, CACHE, SCHED, ExecutorConfig(name="jax", token_buckets=BUCKETS, compilation_cache_dir=None),
        llama=target(), progress=False, spec=spec, draft_model=DRAFT if separate else None,
        draft_llama=first_layers_of(target()) if separate else None,
    )  # fmt: skip
    ex.warmup(sampling=False)
    sched = Scheduler(SCHED, CACHE, SMOLLM.max_model_len, vocab_size=SMOLLM.vocab_size, spec=spec)
    result = serve(requests(), sched, ex)
    assert all(r.finish_reason is FinishReason.LENGTH for r in result.requests)
    assert ex.metrics()["compiles_after_warmup"] == 0
    tokens = {r.request_id: r.output_token_ids for r in result.requests}
    return tokens, sum(r.spec_proposed for r in result.requests), sum(r.spec_accepted for r in result.requests)


@functools.lru_cache(maxsize=None)
def reference() -> dict:
    return run(SpecConfig())[0]


SPECS = {
    "ngram": lambda k: SpecConfig(method="ngram", num_tokens=k),
    "draft_layers": lambda k: SpecConfig(method="draft", num_tokens=k, draft_layers=DRAFT_LAYERS),
    "draft_model": lambda k: SpecConfig(method="draft", num_tokens=k, draft_model=DRAFT.name),
}


@pytest.mark.slow
@pytest.mark.parametrize("k", [1, 3, 5])
@pytest.mark.parametrize("method", sorted(SPECS))
def test_speculation_at_smollm_shape_keeps_greedy_outputs(method, k):
    tokens, proposed, accepted = run(SPECS[method](k))
    assert tokens == reference()
    assert 0 < accepted < proposed  # drafts accepted, and some rejected
