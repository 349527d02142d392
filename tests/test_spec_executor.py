"""The JAX executor verifying drafts, driven by hand-built plans: greedy outputs equal decoding
without drafts whatever the drafts, for host drafts, a draft model and the target's first layers."""

from __future__ import annotations

import dataclasses
import functools
from typing import Optional

import jax
import numpy as np
import pytest
from flax import nnx

from cbjax.config import CacheConfig, ExecutorConfig, ModelConfig, SchedulerConfig
from cbjax.core.plan import Schedule, ScheduledRequest
from cbjax.core.request import SamplingParams
from cbjax.model import Llama
from cbjax.runtime.executor import JaxExecutor

MODEL = ModelConfig(max_model_len=96)
DRAFT = dataclasses.replace(MODEL, name="tiny_draft", num_layers=1)
PAGE_SIZE = 4
SLOTS = 3
PAGES_PER_ROW = MODEL.max_model_len // PAGE_SIZE
BUCKETS = [8, 24]


@dataclasses.dataclass
class Spec:
    """The `spec` group's fields the executor reads."""

    method: str = "none"
    num_tokens: int = 3
    draft_layers: Optional[int] = None


def make_executor(spec: Spec, draft_llama: Optional[Llama] = None, llama: Optional[Llama] = None,
                  sampling: bool = False) -> JaxExecutor:  # fmt: skip
    ex = JaxExecutor(
        MODEL, CacheConfig(num_pages=1 + SLOTS * PAGES_PER_ROW, page_size=PAGE_SIZE),
        SchedulerConfig(max_num_seqs=SLOTS, max_num_batched_tokens=BUCKETS[-1]),
        ExecutorConfig(name="jax", token_buckets=BUCKETS, compilation_cache_dir=None), seed=0, llama=llama,
        progress=False, spec=spec, draft_model=DRAFT if draft_llama is not None else None, draft_llama=draft_llama,
    )  # fmt: skip
    ex.warmup(sampling=sampling)
    return ex


def first_layer_of(target: Llama) -> Llama:
    """A one-layer draft model holding the target's first layer, embeddings, norm and head (its
    own weights, its own KV pool)."""
    draft = Llama(DRAFT, seed=5)
    nnx.update(draft.layers[0], nnx.state(target.layers[0]))
    nnx.update(draft.norm, nnx.state(target.norm))
    draft.embed_tokens.set_value(target.embed_tokens.get_value())
    draft.lm_head.set_value(target.lm_head.get_value())
    return draft


def draft_like_first_layer() -> Llama:
    """The default target's first layer as a draft model: it agrees with the target often, not always."""
    return first_layer_of(Llama(MODEL, seed=0))


def one_layer_target() -> Llama:
    """A two-layer target whose second layer adds nothing (its output matrices zero): its first
    layer and head, a draft, then predict it exactly."""
    target = Llama(MODEL, seed=0)
    for dense in (target.layers[1].o_proj, target.layers[1].down_proj):
        dense.kernel.set_value(dense.kernel.get_value() * 0)
    return target


def prompts(seed=0, num=SLOTS):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, MODEL.vocab_size, rng.integers(4, 18)).tolist() for _ in range(num)]


def generate(ex: JaxExecutor, prompt_ids, max_tokens, k=0, guess=None, temperature=0.0):
    """Greedy outputs of the prompts, one slot each: a prefill step per prompt, then decode steps
    of every row with up to k drafts, `guess(i, out, d)`'s ids (host drafts) or, with guess None
    and k > 0, the executor's drafter's. Returns (outputs, accepted counts, rejected counts)."""
    seqs = [list(p) for p in prompt_ids]
    outs = [[] for _ in prompt_ids]
    accepted = rejected = 0
    for i, p in enumerate(prompt_ids):
        table = tuple(range(1 + i * PAGES_PER_ROW, 1 + (i + 1) * PAGES_PER_ROW))
        entry = ScheduledRequest(str(i), i, 0, len(p), False, token_ids=tuple(p), page_table=table,
                                 sampling=SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=i))  # fmt: skip
        out = ex.execute(Schedule(num_slots=SLOTS, scheduled=[entry], page_size=PAGE_SIZE))
        outs[i].append(out.token_ids[0])
        seqs[i].append(out.token_ids[0])
    while any(len(o) < max_tokens for o in outs):
        live = [i for i, o in enumerate(outs) if len(o) < max_tokens]
        entries = []
        for i in live:
            d = min(k, max_tokens - len(outs[i]) - 1)
            ids = (seqs[i][-1],) + (tuple(guess(i, outs[i], d)) if guess is not None else ())
            entries.append(ScheduledRequest(str(i), i, len(seqs[i]) - 1, 1 + d, True, token_ids=ids, num_drafts=d))
        out = ex.execute(Schedule(num_slots=SLOTS, scheduled=entries, page_size=PAGE_SIZE))
        assert out.errors is None
        for row, i in enumerate(live):
            n = out.num_accepted[row] if out.num_accepted is not None else 0
            new = (list(out.accepted_ids[row]) if n else []) + [out.token_ids[row]]
            accepted += n
            rejected += int(n < entries[row].num_drafts)
            outs[i] += new
            seqs[i] += new
    return outs, accepted, rejected


@functools.lru_cache(maxsize=None)
def reference(max_tokens=24, seed=0):
    outs, _, _ = generate(make_executor(Spec()), prompts(seed), max_tokens)
    return outs


def corrupted_guess(ref, seed=0, wrong=0.3):
    """Drafts from the reference continuation, each wrong with probability `wrong`."""
    rng = np.random.default_rng(seed)

    def guess(i, out, d):
        ids = ref[i][len(out) : len(out) + d]
        return [(t + 1) % MODEL.vocab_size if rng.random() < wrong else t for t in ids]

    return guess


@pytest.mark.parametrize("k", [1, 3, 5])
def test_host_drafts_keep_greedy_outputs(k):
    ref = reference()
    ex = make_executor(Spec("ngram", k))
    outs, accepted, rejected = generate(ex, prompts(), 24, k, corrupted_guess(ref, k))
    assert outs == ref
    assert accepted > 0 and rejected > 0
    m = ex.metrics()
    assert m["compiles_after_warmup"] == 0 and m["device_calls_per_iteration"] == 1.0


@pytest.mark.parametrize("how, k", [("draft_layers", 3), ("draft_model", 5), ("draft_model", 1)])
def test_a_drafter_on_the_device_keeps_greedy_outputs(how, k):
    ref = reference()
    if how == "draft_layers":
        ex = make_executor(Spec("draft", k, draft_layers=1))
    else:
        ex = make_executor(Spec("draft", k), draft_like_first_layer())
    outs, accepted, rejected = generate(ex, prompts(), 24, k)
    assert outs == ref
    assert accepted > 0 and rejected > 0
    m = ex.metrics()
    assert m["compiles_after_warmup"] == 0
    assert 1.0 < m["device_calls_per_iteration"] <= 2.0  # the drafter's call, then the target's


@pytest.mark.parametrize("how", ["draft_layers", "draft_model"])
def test_a_drafter_equal_to_the_target_has_every_draft_accepted(how):
    # Its proposals are the target's own tokens only if its K/V are right at every position:
    # the last draft's too (a draft model's last pass), and, for the target's first layers,
    # each position the draft passes write before the target's step rewrites it.
    target = one_layer_target
    ref, _, _ = generate(make_executor(Spec(), llama=target()), prompts(1), 24)
    draft = first_layer_of(target()) if how == "draft_model" else None
    ex = make_executor(Spec("draft", 3, draft_layers=1 if how == "draft_layers" else None), draft, target())
    outs, accepted, rejected = generate(ex, prompts(1), 24, 3)
    assert outs == ref
    assert accepted > 30 and rejected == 0


def test_a_draft_model_of_the_targets_first_layer_proposes_as_the_first_layers_do():
    # the same draft, through its own pool and through the target's cache: the same proposals
    layers = generate(make_executor(Spec("draft", 3, draft_layers=1)), prompts(2), 24, 3)
    model = generate(make_executor(Spec("draft", 3), draft_like_first_layer()), prompts(2), 24, 3)
    assert layers == model and layers[1] > 0 and layers[2] > 0


def peaked_target() -> Llama:
    """The default target with its head scaled by 50: at temperature 1 its distributions range
    from flat to nearly one-hot, so drafts are accepted at some positions and not at others."""
    target = Llama(MODEL, seed=0)
    target.lm_head.set_value(target.lm_head.get_value() * 50)
    return target


@pytest.mark.parametrize("how", ["ngram", "draft_layers", "draft_model"])
def test_sampling_with_drafts_runs_and_reproduces(how):
    # a step no row drafts in (the prompts' prefill) runs the verification sampler without the
    # drafts' probabilities: warmup compiles that program too
    if how == "ngram":  # guesses: the greedy continuation
        greedy, _, _ = generate(make_executor(Spec(), llama=peaked_target()), prompts(), 16)
        make = lambda: make_executor(Spec("ngram", 3), llama=peaked_target(), sampling=True)  # noqa: E731
        guess = lambda: corrupted_guess(greedy, 1, wrong=0.0)  # noqa: E731
    elif how == "draft_layers":
        jax.clear_caches()  # another test may have compiled that program at these shapes
        make = lambda: make_executor(Spec("draft", 3, draft_layers=1), llama=peaked_target(), sampling=True)  # noqa: E731
        guess = lambda: None  # noqa: E731
    else:
        make = lambda: make_executor(Spec("draft", 3), first_layer_of(peaked_target()), peaked_target(), True)  # noqa: E731
        guess = lambda: None  # noqa: E731
    ex = make()
    first = generate(ex, prompts(), 16, 3, guess(), temperature=1.0)
    again = generate(make(), prompts(), 16, 3, guess(), temperature=1.0)
    assert first == again  # seeded per request: a rerun draws the same
    outs, accepted, rejected = first
    assert all(len(o) == 16 and all(0 <= t < MODEL.vocab_size for t in o) for o in outs)
    assert accepted > 0 and rejected > 0
    m = ex.metrics()
    assert m["compiles_after_warmup"] == 0 and m["sampler_calls"] > 0
