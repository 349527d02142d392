"""Speculative decoding in a batch against alone: greedy drafts depend only on a request's own
context, so each request verifies and accepts the same drafts at every step whether it is
served with others or by itself (for host n-gram drafts, the target's first layers and a
separate draft model), and yields the same tokens."""

from __future__ import annotations

import functools

import numpy as np
import pytest

from cbjax.config import CacheConfig, ExecutorConfig, SchedulerConfig, SpecConfig
from cbjax.core.request import Request, SamplingParams
from cbjax.engine.offline import serve
from cbjax.runtime.executor import JaxExecutor
from cbjax.scheduler import Scheduler
from test_spec_executor import DRAFT, MODEL, draft_like_first_layer

NUM = 4  # requests, all in the batch
PAGE_SIZE = 4  # drafts cross page boundaries every few steps
SCHED = SchedulerConfig(max_num_seqs=NUM, max_num_batched_tokens=64)  # every prompt prefills in one step
CACHE = CacheConfig(num_pages=1 + NUM * (MODEL.max_model_len // PAGE_SIZE), page_size=PAGE_SIZE, prefix_caching=False)
BUCKETS = [16, 64]
SPECS = {
    "ngram": SpecConfig(method="ngram", num_tokens=3),
    "draft_layers": SpecConfig(method="draft", num_tokens=3, draft_layers=1),
    "draft_model": SpecConfig(method="draft", num_tokens=3, draft_model="tiny_draft"),
}


def prompts() -> list[list[int]]:
    """Prompts of 5-15 tokens, each a short random phrase repeated: greedy outputs of the tiny
    random model then repeat too, so n-gram lookups find drafts."""
    rng = np.random.default_rng(7)
    out = []
    for _ in range(NUM):
        phrase = rng.integers(0, MODEL.vocab_size, rng.integers(2, 5)).tolist()
        out.append((phrase * 8)[: rng.integers(5, 16)])
    return out


@functools.lru_cache(maxsize=None)
def executor(method: str) -> JaxExecutor:
    draft = draft_like_first_layer() if method == "draft_model" else None
    ex = JaxExecutor(
        MODEL, CACHE, SCHED, ExecutorConfig(name="jax", token_buckets=BUCKETS, compilation_cache_dir=None),
        progress=False, spec=SPECS[method], draft_model=DRAFT if draft is not None else None, draft_llama=draft,
    )  # fmt: skip
    ex.warmup(sampling=False)
    return ex


def serve_ids(method: str, ids: list[int]) -> dict[str, Request]:
    spec = SPECS[method]
    sched = Scheduler(SCHED, CACHE, MODEL.max_model_len, vocab_size=MODEL.vocab_size, spec=spec)
    reqs = [Request(str(i), 0.0, len(p), prompt_token_ids=list(p), sampling=SamplingParams(max_tokens=24, ignore_eos=True))
            for i, p in ((i, prompts()[i]) for i in ids)]  # fmt: skip
    return {r.request_id: r for r in serve(reqs, sched, executor(method)).requests}


@pytest.mark.parametrize("method", list(SPECS))
def test_each_request_accepts_the_same_drafts_in_a_batch_as_alone(method):
    batched = serve_ids(method, list(range(NUM)))
    for i in range(NUM):
        alone = serve_ids(method, [i])[str(i)]
        together = batched[str(i)]
        assert together.output_token_ids == alone.output_token_ids, i
        assert together.spec_steps == alone.spec_steps, i  # (drafts verified, accepted) per decode step
    proposed = sum(r.spec_proposed for r in batched.values())
    accepted = sum(r.spec_accepted for r in batched.values())
    assert 0 < accepted < proposed  # drafts accepted, and some rejected
    assert executor(method).metrics()["compiles_after_warmup"] == 0
