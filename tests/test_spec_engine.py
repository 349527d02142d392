"""Speculative decoding end to end on the JAX engine (the scheduler's drafts, the executor's
verification): greedy outputs equal those without speculation under chunked prefill, prefix
caching, recompute and swap preemption, tensor parallelism and P/D replicas; no compiles after
warmup; several tokens of a step stream to cbjax-serve's client in order."""

from __future__ import annotations

import functools
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from cbjax.config import CacheConfig, ExecutorConfig, SchedulerConfig, SpecConfig
from cbjax.core.plan import Schedule, ScheduledRequest
from cbjax.core.request import FinishReason, Request, SamplingParams
from cbjax.engine.offline import serve
from cbjax.runtime.executor import JaxExecutor
from cbjax.scheduler import Scheduler
from test_spec_executor import DRAFT, MODEL, first_layer_of, one_layer_target

TESTS = Path(__file__).resolve().parent
BUCKETS = [8, 32]
SHARED = (np.arange(12) * 37 % MODEL.vocab_size).tolist()  # 3 pages every prompt starts with


def workload(num=8, seed=3) -> list[Request]:
    """Prompts of a shared prefix and 2-14 random tokens, 28 greedy outputs each, arriving at once."""
    rng = np.random.default_rng(seed)
    reqs = []
    for i in range(num):
        prompt = SHARED + rng.integers(0, MODEL.vocab_size, rng.integers(2, 15)).tolist()
        reqs.append(Request(str(i), 0.0, len(prompt), prompt_token_ids=prompt,
                            sampling=SamplingParams(max_tokens=28, ignore_eos=True)))  # fmt: skip
    return reqs


def run(spec: SpecConfig, num_pages=200, preemption="recompute", llama=None, draft_llama=None):
    sched_cfg = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=32, chunked_prefill=True, preemption=preemption)
    cache = CacheConfig(num_pages=num_pages, page_size=4, prefix_caching=True)
    ex = JaxExecutor(
        MODEL, cache, sched_cfg, ExecutorConfig(name="jax", token_buckets=BUCKETS, compilation_cache_dir=None),
        llama=llama, progress=False, spec=spec, draft_model=DRAFT if draft_llama is not None else None,
        draft_llama=draft_llama,
    )  # fmt: skip
    ex.warmup(sampling=False)
    sched = Scheduler(sched_cfg, cache, MODEL.max_model_len, validate=ex.validate, vocab_size=MODEL.vocab_size,
                      spec=spec)  # fmt: skip
    result = serve(workload(), sched, ex)
    assert all(r.finish_reason is FinishReason.LENGTH for r in result.requests)
    assert ex.metrics()["compiles_after_warmup"] == 0
    return {r.request_id: r.output_token_ids for r in result.requests}, result, ex


@functools.lru_cache(maxsize=None)
def reference(one_layer: bool = False) -> dict:
    return run(SpecConfig(), llama=one_layer_target() if one_layer else None)[0]


# A tight pool: 4 requests of up to 54 tokens (14 pages, 3 of them shared) need 47 pages, 30
# are usable; drafts take pages too.
TIGHT = 31


@pytest.mark.parametrize("method, k, preemption", [("ngram", 3, "recompute"), ("draft_layers", 5, "swap")])
def test_speculation_keeps_greedy_outputs_through_chunks_prefix_hits_and_preemption(method, k, preemption):
    spec = SpecConfig(method="ngram", num_tokens=k) if method == "ngram" else SpecConfig(
        method="draft", num_tokens=k, draft_layers=1)  # fmt: skip
    out, result, ex = run(spec, TIGHT, preemption)
    assert out == reference()
    assert result.preemptions > 0 and result.extra["prefix_cache_hit_rate"] > 0
    assert (result.extra["swap_preemptions"] > 0) == (preemption == "swap")
    proposed = sum(r.spec_proposed for r in result.requests)
    accepted = sum(r.spec_accepted for r in result.requests)
    assert 0 < accepted < proposed  # drafts accepted, and some rejected
    assert ex.metrics()["device_calls_per_iteration"] <= (1.0 if method == "ngram" else 2.0)


def test_a_draft_models_pool_moves_with_swaps():
    # A draft model equal to the target accepts every draft only while its own pool holds the
    # right K/V, through swap preemptions too.
    draft = first_layer_of(one_layer_target())
    out, result, ex = run(SpecConfig(method="draft", num_tokens=2, draft_model="tiny_draft"), TIGHT, "swap",
                          one_layer_target(), draft)  # fmt: skip
    assert out == reference(one_layer=True)
    assert result.extra["swap_preemptions"] > 0
    proposed = sum(r.spec_proposed for r in result.requests)
    assert proposed > 100 and sum(r.spec_accepted for r in result.requests) == proposed
    assert ex.spec.swap.num_out_pages > 0


def test_tensor_parallel_and_prefill_decode_replicas_keep_outputs(env_cpu):
    """TP 2 and a 1 prefill + 1 decode cluster, with a draft model equal to the target (its
    pool sharded, and carried from the prefill replica with the target's K/V)."""
    env = dict(env_cpu, XLA_FLAGS="--xla_force_host_platform_device_count=8")
    proc = subprocess.run(
        [sys.executable, str(TESTS / "spec_engine_runs.py"), "tp2:ngram", "tp2:model", "pd:model"],
        capture_output=True, text=True, env=env, cwd=TESTS, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    runs = json.loads(proc.stdout.strip().splitlines()[-1])
    ref = reference(one_layer=True)  # the same workload on one device, no speculation
    for name in ("tp2:ngram", "tp2:model", "pd:model"):
        r = runs[name]
        assert r["tokens"] == ref, name
        assert r["compiles_after_warmup"] == [0] * len(r["compiles_after_warmup"]), name
        assert r["accepted"] > 0, name
    assert runs["tp2:ngram"]["accepted"] < runs["tp2:ngram"]["proposed"]
    for name in ("tp2:model", "pd:model"):  # the draft equals the target: nothing is rejected
        assert runs[name]["accepted"] == runs[name]["proposed"], name
    assert runs["tp2:model"]["mesh_tensor"] == [2] and runs["pd:model"]["kv_transfers"] > 0


def test_tokens_of_a_step_stream_to_the_client_in_order():
    """The loop's token callback sees each accepted draft, then the step's own token."""
    spec = SpecConfig(method="ngram", num_tokens=3)
    sched_cfg = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=32)
    cache = CacheConfig(num_pages=200, page_size=4)
    ex = JaxExecutor(MODEL, cache, sched_cfg, ExecutorConfig(name="jax", token_buckets=BUCKETS,
                     compilation_cache_dir=None), progress=False, spec=spec)  # fmt: skip
    ex.warmup(sampling=False)
    sched = Scheduler(sched_cfg, cache, MODEL.max_model_len, vocab_size=MODEL.vocab_size, spec=spec)
    from cbjax.engine.loop import EngineLoop

    streamed: dict[str, list[int]] = {}
    per_step: list[int] = []
    loop = EngineLoop(sched, ex, on_token=lambda r, t, now: streamed.setdefault(r.request_id, []).append(t),
                      on_step=lambda plan, end, n, reqs: per_step.append(len(plan.scheduled)))  # fmt: skip
    for req in workload(4):
        loop.add(req, 0.0)
    while loop.step():
        loop.boundary()
    loop.settle()
    outputs = {r.request_id: r.output_token_ids for r in loop.requests}
    assert streamed == outputs
    assert sum(len(v) for v in outputs.values()) > sum(per_step)  # some steps yielded several tokens


def test_speculation_refuses_what_it_cannot_run():
    cache = CacheConfig(num_pages=64, page_size=4)
    sched = SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=32)
    exc = ExecutorConfig(name="jax", token_buckets=BUCKETS, compilation_cache_dir=None)
    with pytest.raises(ValueError, match="spec.draft_layers must be in"):
        JaxExecutor(MODEL, cache, sched, exc, progress=False, spec=SpecConfig(method="draft", draft_layers=2))
    wide = DRAFT.__class__(**{**DRAFT.__dict__, "vocab_size": 1024})
    with pytest.raises(ValueError, match="vocab_size 1024 differs"):
        JaxExecutor(MODEL, cache, sched, exc, progress=False, spec=SpecConfig(method="draft", draft_model="x"),
                    draft_model=wide)  # fmt: skip
    ex = JaxExecutor(MODEL, cache, sched, exc, progress=False, spec=SpecConfig(method="draft", draft_layers=1))
    row = ScheduledRequest("7", 0, 0, 5, False, token_ids=(1, 2, 3), page_table=(1, 2), num_drafts=2)
    with pytest.raises(ValueError, match="request 7: drafts with spec.draft_layers need a decode row"):
        ex.packer.pack(Schedule(num_slots=2, scheduled=[row], page_size=4))


def test_cbjax_serve_streams_a_speculating_engines_tokens_in_order(tmp_path):
    """cbjax-serve on the JAX engine with n-gram drafts: a streamed completion's chunks, one per
    token, spell the unstreamed completion of the same prompt (greedy), drafts accepted."""
    import openai

    from test_serve import rows, running

    engine = ["executor=jax", "model=tiny", "model.max_model_len=128", "spec=ngram", "scheduler.max_num_seqs=2",
              "scheduler.max_num_batched_tokens=32", "executor.token_buckets=[8,32]", "cache.num_pages=80"]  # fmt: skip
    with running(tmp_path, *engine) as (base, _):
        client = openai.OpenAI(base_url=base, api_key="unused")
        whole = client.completions.create(model="tiny", prompt=[5, 6, 7, 8], max_tokens=40, temperature=0)
        chunks = list(client.completions.create(model="tiny", prompt=[5, 6, 7, 8], max_tokens=40, temperature=0,
                                                stream=True))  # fmt: skip
        streamed = [c.choices[0].text for c in chunks if c.choices and c.choices[0].text]
        assert "".join(streamed) == whole.choices[0].text and len(streamed) > 1
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["compiles_after_warmup"] == 0
    served = rows(tmp_path)
    assert [r["output_len"] for r in served] == [40, 40]
    assert all(0 < r["spec_accepted"] <= r["spec_proposed"] for r in served)


def test_cli_engine_run_writes_its_acceptance_trace(tmp_path, env_cpu):
    from conftest import cbjax_cmd

    trace = tmp_path / "w.jsonl"
    trace.write_text("".join(json.dumps({"arrival_s": 0.0, "prompt_token_ids": r.prompt_token_ids, "max_tokens": 20})
                             + "\n" for r in workload(4)))  # fmt: skip
    out = tmp_path / "run"
    cmd = cbjax_cmd() + [
        "executor=jax", "spec=ngram", "scheduler.max_num_seqs=4", "scheduler.max_num_batched_tokens=32",
        "model.max_model_len=128", "executor.token_buckets=[8,32]", "workload=trace", f"workload.path={trace}",
        "progress=false", f"hydra.run.dir={out}",
    ]  # fmt: skip
    proc = subprocess.run(cmd, env=env_cpu, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = {r["request_id"]: r for r in map(json.loads, (out / "requests.jsonl").read_text().splitlines())}
    steps = {t["request_id"]: t for t in map(json.loads, (out / "spec_trace.jsonl").read_text().splitlines())}
    assert steps.keys() == rows.keys()
    for rid, row in rows.items():  # each decode step's accepted drafts, as the engine verified them
        assert sum(steps[rid]["accepted"]) == row["spec_accepted"] and sum(steps[rid]["proposed"]) == row["spec_proposed"]
        assert len(row["output_token_ids"]) == 20 == 1 + len(steps[rid]["accepted"]) + row["spec_accepted"]
    assert sum(r["spec_accepted"] for r in rows.values()) > 0
    assert json.loads((out / "summary.json").read_text())["compiles_after_warmup"] == 0


def test_a_draft_model_named_in_the_config_gets_its_own_weights_and_pool():
    from cbjax.app.run import build_executor
    from cbjax.config import RunConfig

    cfg = RunConfig(model=MODEL, executor=ExecutorConfig(name="jax", token_buckets=BUCKETS, compilation_cache_dir=None),
                    cache=CacheConfig(num_pages=64, page_size=4), spec=SpecConfig(method="draft", draft_model="tiny_draft"),
                    scheduler=SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=32), progress=False)  # fmt: skip
    ex = build_executor(cfg)
    assert ex.spec.separate and ex.spec.model_cfg.num_layers == 1 and ex.spec.cache.k.shape[0] == 1
    assert ex.spec.cache.k.shape[2:4] == ex.cache.k.shape[2:4]  # the target's pages, on its page tables
    assert not ex.pipelined
