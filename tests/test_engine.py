"""The JAX engine end to end: continuous batching must produce exactly what decoding alone does."""

import collections
import functools
import json
import shutil
import subprocess

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from conftest import cbjax_cmd, native_unavailable
from cbjax.config import CacheConfig, ExecutorConfig, ModelConfig, SchedulerConfig
from cbjax.engine.loop import EngineLoop
from cbjax.engine.offline import serve
from cbjax.model import Llama, forward_dense
from cbjax.core.request import FinishReason, Request, SamplingParams
from cbjax.runtime import programs
from cbjax.runtime.executor import JaxExecutor
from cbjax.runtime.kv_cache import init_cache
from cbjax.runtime.swap import HostSwap
from cbjax.scheduler import Scheduler

# The tiny model with a short context and a 64-token budget, so few token buckets compile.
MODEL = ModelConfig(max_model_len=128)
BUCKETS = [4, 16, 64]
BUDGET = 64  # the largest step: the largest bucket


def make_executor(
    num_slots, num_pages=512, page_size=4, chunked=False, preemption="recompute", cache_kw=None, **exec_kw
):
    return JaxExecutor(
        MODEL,
        CacheConfig(num_pages=num_pages, page_size=page_size, **(cache_kw or {})),
        SchedulerConfig(
            max_num_seqs=num_slots, max_num_batched_tokens=BUDGET, chunked_prefill=chunked, preemption=preemption
        ),
        ExecutorConfig(name="jax", token_buckets=BUCKETS, **exec_kw),
        seed=0,
    )


def workload(num, wseed, max_prompt=40, max_out=20, stagger_s=0.002, **sampling):
    rng = np.random.default_rng(wseed)
    reqs = []
    for i in range(num):
        prompt = rng.integers(0, MODEL.vocab_size, rng.integers(1, max_prompt + 1)).tolist()
        reqs.append(
            Request(
                request_id=str(i),
                arrival_s=i * stagger_s,
                prompt_len=len(prompt),
                prompt_token_ids=prompt,
                sampling=SamplingParams(max_tokens=int(rng.integers(1, max_out + 1)), ignore_eos=True, **sampling),
            )
        )
    return reqs


def fresh(req):
    """A new request with the same inputs and none of the scheduler's state."""
    return Request(
        req.request_id, req.arrival_s, req.prompt_len, list(req.prompt_token_ids), req.sampling
    )


def run_engine(
    reqs, num_slots, num_pages=512, page_size=4, chunked=False, preemption="recompute", cache_kw=None, policy="fcfs",
    **exec_kw,
):
    ex = make_executor(num_slots, num_pages, page_size, chunked, preemption, cache_kw, **exec_kw)
    sched = Scheduler(
        SchedulerConfig(
            name=policy, max_num_seqs=num_slots, max_num_batched_tokens=BUDGET, chunked_prefill=chunked,
            preemption=preemption,
        ),
        CacheConfig(num_pages=num_pages, page_size=page_size, **(cache_kw or {})),
        MODEL.max_model_len,
        validate=ex.validate,
        vocab_size=MODEL.vocab_size,
    )
    ex.warmup()
    result = serve([fresh(r) for r in reqs], sched, ex)
    return {r.request_id: r for r in result.requests}, result, ex


@functools.lru_cache(maxsize=1)
def dense_oracle():
    """Greedy argmax of a dense, cache-free forward pass over the whole sequence at each step.

    Sequences are padded to max_model_len; causal attention makes the padding invisible."""
    graphdef, state = nnx.split(Llama(MODEL, seed=0))  # the executors' weights (seed 0), unfused
    fwd = jax.jit(lambda state, tokens: forward_dense(nnx.merge(graphdef, state), tokens))

    def generate(prompt, num_tokens):
        seq = list(prompt)
        for _ in range(num_tokens):
            padded = np.zeros(MODEL.max_model_len, np.int32)
            padded[: len(seq)] = seq
            logits = np.asarray(fwd(state, jnp.asarray(padded)))[len(seq) - 1]
            top2 = np.sort(logits)[-2:]
            assert top2[1] - top2[0] > 1e-4, "near-tie in the oracle: pick another seed"
            seq.append(int(logits.argmax()))
        return seq[len(prompt) :]

    return generate


def test_continuous_batching_equals_alone_and_dense_oracle():
    reqs = workload(14, wseed=0)
    for req in reqs[:4]:  # the slots fill at once whatever the machine's speed; the rest arrive staggered
        req.arrival_s = 0.0
    batched, result, ex = run_engine(reqs, num_slots=4)
    alone, _, _ = run_engine(reqs, num_slots=1)
    dense_attention, _, _ = run_engine(reqs, num_slots=4, attention="reference")
    oracle = dense_oracle()
    # on CPU the default attention is native where its package is installed and builds, else
    # ragged; one model call per iteration, in several token buckets
    if jax.default_backend() == "cpu":
        assert ex.metrics()["attention"] == ("native" if native_unavailable() is None else "ragged")
    assert ex.metrics()["device_calls_per_iteration"] == 1.0
    assert len(ex.metrics()["bucket_calls"]) >= 2
    # slots were refilled many times
    assert len(reqs) > 3 * 4 and result.stats.batch_peak == 4
    for req in reqs:
        got = batched[req.request_id]
        assert got.finish_reason is FinishReason.LENGTH
        assert len(got.output_token_ids) == req.sampling.max_tokens
        assert got.output_token_ids == alone[req.request_id].output_token_ids, req.request_id
        assert got.output_token_ids == dense_attention[req.request_id].output_token_ids, req.request_id
        assert got.output_token_ids == oracle(req.prompt_token_ids, req.sampling.max_tokens), req.request_id


def test_static_batching_generates_what_decoding_alone_does():
    """The baseline of every comparison runs the same model: a batch forms only when the last
    one has ended, and each request's greedy tokens are the dense oracle's."""
    reqs = workload(9, wseed=3, max_out=12, stagger_s=0.0)
    # steps one at a time: a pipelined step is stamped when its tokens are read, after the next
    # step (a new batch's prefill) is launched
    static, _, _ = run_engine(reqs, num_slots=4, policy="static", async_scheduling=False)
    oracle = dense_oracle()
    for req in reqs:
        assert static[req.request_id].output_token_ids == oracle(req.prompt_token_ids, req.sampling.max_tokens)
    # a batch is what one prefill step admits (its prompts within the step's token budget, at
    # most the slots), in arrival order; none starts before the one before it has ended
    done = sorted(static.values(), key=lambda r: int(r.request_id))
    batches = [[r for r in done if r.scheduled_s == t] for t in sorted({r.scheduled_s for r in done})]
    assert [r for b in batches for r in b] == done and len(batches) >= 3
    for before, after in zip(batches, batches[1:]):
        assert sum(r.prompt_len for r in before) + after[0].prompt_len > BUDGET or len(before) == 4
        assert min(r.scheduled_s for r in after) >= max(r.finish_s for r in before)


def test_preemption_by_recompute_keeps_outputs_identical():
    reqs = workload(8, wseed=1, max_prompt=30, max_out=30, stagger_s=0.0)
    for req in reqs[:2]:  # two long ones first: 60 prompt tokens, 30 to generate
        req.prompt_token_ids = (req.prompt_token_ids * 60)[:60]
        req.prompt_len = 60
        req.sampling = SamplingParams(max_tokens=30, ignore_eos=True)
    ample, _, _ = run_engine(reqs, num_slots=4)
    # 34 pages of 4 tokens cannot hold both long sequences at 90 tokens: the later one is
    # preempted, and with more than BUDGET tokens it re-prefills in pieces over its cache.
    tight, result, ex = run_engine(reqs, num_slots=4, num_pages=35)
    assert result.preemptions > 0
    assert ex.metrics()["device_calls_per_iteration"] == 1.0
    for rid, req in ample.items():
        assert tight[rid].output_token_ids == req.output_token_ids, rid


def test_chunked_prefill_keeps_outputs_identical():
    # Prompts up to 60 tokens under a 64-token budget shared with decodes: most prompts are
    # split, the later chunks attend to their cached first chunk.
    reqs = workload(10, wseed=7, max_prompt=60, max_out=12, stagger_s=0.0)
    plain, _, _ = run_engine(reqs, num_slots=4)
    chunked, result, ex = run_engine(reqs, num_slots=4, chunked=True)
    assert result.stats.iterations > 0 and ex.metrics()["compiles_after_warmup"] == 0
    assert ex.metrics()["device_calls_per_iteration"] == 1.0
    assert all(chunked[r].output_token_ids == plain[r].output_token_ids for r in plain)


@pytest.mark.parametrize("preemption", ["recompute", "swap"])
def test_tight_pool_with_chunked_prefill_and_prefix_caching_preempts_and_keeps_outputs(preemption):
    # A page pool too small for the load forces preemption, with chunked prefill and prefix
    # caching on, in both preemption modes; greedy outputs must still equal decoding each
    # request alone, and preemptions > 0 must be reported.
    reqs = workload(8, wseed=8, max_prompt=16, max_out=24, stagger_s=0.0)
    shared = (np.arange(28) * 37 % MODEL.vocab_size).tolist()  # 7 pages every prompt starts with
    for req in reqs:
        req.prompt_token_ids = shared + req.prompt_token_ids
        req.prompt_len = len(req.prompt_token_ids)
        req.sampling = SamplingParams(max_tokens=24, ignore_eos=True)
    alone, _, _ = run_engine(reqs, num_slots=1)
    # At full length a request holds up to 65 tokens (17 pages, 7 of them the shared prefix):
    # 4 slots need 7 + 4 * 10 = 47 pages, more than the 30 usable. Host swap space is 31
    # pages, so in swap mode a later victim may find it full and be recomputed.
    out, result, ex = run_engine(
        reqs, num_slots=4, num_pages=31, chunked=True, preemption=preemption, cache_kw=dict(prefix_caching=True)
    )
    assert result.preemptions > 0
    assert result.extra["prefix_cache_hit_rate"] > 0
    assert (result.extra["swap_preemptions"] > 0) == (preemption == "swap")
    assert ex.metrics()["compiles_after_warmup"] == 0
    for rid, req in alone.items():
        assert out[rid].finish_reason is FinishReason.LENGTH
        assert out[rid].output_token_ids == req.output_token_ids, rid


def test_pipelined_serving_equals_one_step_at_a_time_and_stops_on_tokens():
    """executor.async_scheduling (the default) launches step t+1 before step t's tokens are
    read. Outputs and finish reasons must equal one step at a time, requests that stop on a
    token included (their row in the step launched meanwhile is wasted, then dropped)."""
    reqs = workload(10, wseed=3, max_prompt=40, max_out=20, stagger_s=0.0)
    base, _, _ = run_engine(reqs, num_slots=4, chunked=True, async_scheduling=False)
    counts = collections.Counter(t for r in base.values() for t in r.output_token_ids[1:-1])
    stop = counts.most_common(1)[0][0]  # a token several requests generate mid-output
    for req in reqs:
        req.sampling = SamplingParams(max_tokens=req.sampling.max_tokens, ignore_eos=True, stop_token_ids=[stop])

    def expected(rid):  # the unstopped output cut after its first stop token
        out = base[rid].output_token_ids
        return (out[: out.index(stop) + 1], FinishReason.STOP) if stop in out else (out, FinishReason.LENGTH)

    sync, _, sync_ex = run_engine(reqs, num_slots=4, chunked=True, async_scheduling=False)
    ex = make_executor(4, chunked=True)
    in_flight, overlapped = [], []
    launch, collect = ex.launch, ex.collect

    def spy_launch(plan):
        overlapped.append(bool(in_flight))
        in_flight.append(launch(plan))
        return in_flight[-1]

    def spy_collect(launched):
        in_flight.remove(launched)
        return collect(launched)

    ex.launch, ex.collect = spy_launch, spy_collect
    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=BUDGET, chunked_prefill=True),
                      CacheConfig(num_pages=512, page_size=4), MODEL.max_model_len, vocab_size=MODEL.vocab_size)  # fmt: skip
    ex.warmup()
    result = serve([fresh(r) for r in reqs], sched, ex)
    assert sum(overlapped) > len(overlapped) // 2 and not in_flight  # most steps launched with one in flight
    assert ex.metrics()["async_scheduling"] and not sync_ex.metrics()["async_scheduling"]
    assert ex.metrics()["device_calls_per_iteration"] == 1.0 and ex.metrics()["compiles_after_warmup"] == 0
    stopped = 0
    for req in result.requests:
        want, reason = expected(req.request_id)
        assert (req.output_token_ids, req.finish_reason) == (want, reason), req.request_id
        got = sync[req.request_id]
        assert (got.output_token_ids, got.finish_reason) == (want, reason), req.request_id
        assert req.num_generated == len(want) and req.scheduled_s <= req.first_token_s <= req.finish_s
        stopped += reason is FinishReason.STOP and len(want) < req.sampling.max_tokens
    assert stopped >= 2
    assert len(result.tbt_s) == sum(len(r.output_token_ids) - 1 for r in result.requests)


def test_cancelling_a_swapped_out_request_drops_its_host_copy():
    """A request cancelled while swapped out gives back its host pages in the scheduler's count
    and in the executor's memory; the others generate what they do alone."""
    reqs = workload(4, wseed=1, max_prompt=30, max_out=30, stagger_s=0.0)
    for req in reqs:  # 56-token prompts, 30 to generate: two slots of 22 pages outgrow 39
        req.prompt_token_ids = (req.prompt_token_ids * 60)[:56]
        req.prompt_len = 56
        req.sampling = SamplingParams(max_tokens=30, ignore_eos=True)
    alone, _, _ = run_engine(reqs, num_slots=1, chunked=True)
    ex = make_executor(2, num_pages=40, chunked=True, preemption="swap")
    sched = Scheduler(
        SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=BUDGET, chunked_prefill=True, preemption="swap"),
        CacheConfig(num_pages=40, page_size=4), MODEL.max_model_len, vocab_size=MODEL.vocab_size,
    )  # fmt: skip
    ex.warmup()
    loop = EngineLoop(sched, ex)
    for req in reqs:
        loop.intake.submit(fresh(req))
    loop.boundary()
    cancelled = None
    while loop.step():
        swapped = [r.request_id for r in sched.policy if sched.waiting.host_pages(r)]
        if swapped and cancelled is None:
            cancelled = swapped[0]
            loop.intake.cancel(cancelled, "cancelled", FinishReason.ABORTED)
        loop.boundary()
    loop.settle()
    out = {r.request_id: r for r in loop.requests}
    assert cancelled is not None and out[cancelled].finish_reason is FinishReason.ABORTED
    assert sched.swap_used == 0 and list(ex._swap._host) == []
    sched.allocator.check_invariants()
    assert sched.allocator.num_used_pages == 0 and sched.slots == [None, None]
    for rid, req in alone.items():
        if rid != cancelled:
            assert out[rid].output_token_ids == req.output_token_ids, rid


def test_swap_round_trip_restores_pages_exactly():
    # bfloat16 pages; 11 pages at widths [2, 4]: calls of 4, 4 and 3 padded to 4.
    cfg = ModelConfig(max_model_len=64, dtype="bfloat16")
    cache = init_cache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, num_pages=24, page_size=4, dtype=cfg.dtype)
    rng = np.random.default_rng(0)
    cache = type(cache)(
        k=jnp.asarray(rng.standard_normal(cache.k.shape), cache.k.dtype),
        v=jnp.asarray(rng.standard_normal(cache.v.shape), cache.v.dtype),
    )
    before_k, before_v = np.asarray(cache.k), np.asarray(cache.v)
    swap = HostSwap([2, 4])
    cache = swap.warmup(cache)
    a, b = "a", "b"
    src_a, src_b = [3, 7, 1, 20, 11, 12], [5, 2, 9, 17, 23]
    swap.swap_out(cache, [(a, src_a), (b, src_b)])
    dst_b, dst_a = [4, 6, 8, 10, 13], [14, 15, 16, 18, 19, 21]
    cache = swap.swap_in(cache, [(b, dst_b), (a, dst_a)])
    after_k, after_v = np.asarray(cache.k), np.asarray(cache.v)
    for src, dst in ((src_a, dst_a), (src_b, dst_b)):
        np.testing.assert_array_equal(after_k[:, :, dst], before_k[:, :, src])
        np.testing.assert_array_equal(after_v[:, :, dst], before_v[:, :, src])
    untouched = [p for p in range(1, 24) if p not in dst_a + dst_b]
    np.testing.assert_array_equal(after_k[:, :, untouched], before_k[:, :, untouched])
    assert (swap.num_out_pages, swap.num_in_pages) == (11, 11)


def _request(rid):
    return Request(rid, 0.0, 1, prompt_token_ids=[0])


def test_no_compiles_after_warmup_over_200_iterations():
    reqs = workload(60, wseed=2, max_prompt=60, max_out=30, stagger_s=0.001)
    _, result, ex = run_engine(reqs, num_slots=4)
    assert result.stats.iterations >= 200
    assert ex.metrics()["compiles_after_warmup"] == 0


def test_sampling_is_seeded_per_request_not_per_slot():
    reqs = workload(6, wseed=3, temperature=0.8, top_k=50, top_p=0.9, seed=7)
    a, _, _ = run_engine(reqs, num_slots=3)
    b, _, _ = run_engine(reqs, num_slots=1)
    assert all(a[r].output_token_ids == b[r].output_token_ids for r in a)
    greedy = {r.request_id: r.output_token_ids for r in run_engine(workload(6, wseed=3), num_slots=3)[0].values()}
    assert any(a[r].output_token_ids != greedy[r] for r in a), "temperature 0.8 never left greedy"
    top1 = workload(6, wseed=3, temperature=1.5, top_k=1, seed=7)
    assert {r: q.output_token_ids for r, q in run_engine(top1, num_slots=3)[0].items()} == greedy


def test_bad_requests_are_rejected_by_name_and_the_run_goes_on():
    reqs = workload(3, wseed=4)
    reqs[1].prompt_token_ids = [1, 2, 9999]
    reqs[1].prompt_len = 3
    reqs[2].prompt_token_ids = [1] * 200
    reqs[2].prompt_len = 200
    out, _, _ = run_engine(reqs, num_slots=2)
    assert out["0"].finish_reason is FinishReason.LENGTH
    assert "request 1: prompt token id 9999 is outside the vocabulary" in out["1"].reject_reason
    assert "prompt has 200 tokens, model max_model_len is 128" in out["2"].reject_reason


def test_cli_slots_4_and_1_give_identical_tokens(tmp_path, env_cpu):
    reqs = workload(10, wseed=5, stagger_s=0.01)
    trace = tmp_path / "w.jsonl"
    trace.write_text(
        "".join(
            json.dumps({"arrival_s": r.arrival_s, "prompt_token_ids": r.prompt_token_ids, "max_tokens": r.sampling.max_tokens})
            + "\n"
            for r in reqs
        )
    )
    tokens = {}
    for slots in (4, 1):
        out = tmp_path / f"slots{slots}"
        cmd = cbjax_cmd() + [
            "executor=jax", f"scheduler.max_num_seqs={slots}", f"scheduler.max_num_batched_tokens={BUDGET}",
            "model.max_model_len=128", f"executor.token_buckets=[{','.join(map(str, BUCKETS))}]",
            "workload=trace", f"workload.path={trace}", "progress=false", f"hydra.run.dir={out}",
        ]  # fmt: skip
        proc = subprocess.run(cmd, env=env_cpu, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
        rows = [json.loads(x) for x in (out / "requests.jsonl").read_text().splitlines()]
        tokens[slots] = {r["request_id"]: r["output_token_ids"] for r in rows}
        summary = json.loads((out / "summary.json").read_text())
        assert summary["compiles_after_warmup"] == 0 and summary["num_finished"] == 10
    assert tokens[4] == tokens[1]
    assert all(len(t) == r.sampling.max_tokens for t, r in zip(tokens[4].values(), reqs))


@pytest.mark.skipif(jax.default_backend() == "cpu", reason="compiled Pallas needs a GPU or TPU")
def test_compiled_pallas_engine_matches_reference_engine():
    reqs = workload(10, wseed=6)
    ref, _, _ = run_engine(reqs, num_slots=4, attention="reference")
    pallas, _, _ = run_engine(reqs, num_slots=4, attention="pallas")
    assert all(pallas[r].output_token_ids == ref[r].output_token_ids for r in ref)


@pytest.mark.skipif(jax.default_backend() != "gpu", reason="the Triton lowering needs a GPU")
def test_triton_engine_matches_reference_engine():
    reqs = workload(10, wseed=6)
    ref, _, _ = run_engine(reqs, num_slots=4, page_size=16, attention="reference")
    tri, _, _ = run_engine(reqs, num_slots=4, page_size=16, attention="triton")
    assert all(tri[r].output_token_ids == ref[r].output_token_ids for r in ref)


def test_one_forward_per_iteration_mixes_decodes_fresh_prefills_chunks_and_prefix_hits():
    """Staggered arrivals under chunked prefill and prefix caching: iterations mix decodes with
    fresh prefills, chunks continuing context and prefix-cache hits, each in one model call;
    the tokens equal serving one request at a time."""
    reqs = workload(10, wseed=9, max_prompt=40, max_out=16, stagger_s=0.0)
    shared = (np.arange(12) * 11 % MODEL.vocab_size).tolist()  # 3 full pages shared by half the prompts
    for i, req in enumerate(reqs):
        req.arrival_s = 0.0 if i < 3 else 1e-4 * i  # later ones join a running batch
        if i % 2:
            req.prompt_token_ids = shared + req.prompt_token_ids
            req.prompt_len = len(req.prompt_token_ids)
    kw = dict(chunked=True, cache_kw=dict(prefix_caching=True))
    out, result, ex = run_engine(reqs, num_slots=4, **kw)
    alone, _, _ = run_engine(reqs, num_slots=1, **kw)
    m = ex.metrics()
    assert m["device_calls_per_iteration"] == 1.0 and m["compiles_after_warmup"] == 0
    assert result.extra["prefix_cache_hit_rate"] > 0
    assert ex.mixed_iterations > 0 and ex.context_iterations > 0
    for rid, req in alone.items():
        assert out[rid].output_token_ids == req.output_token_ids, rid


def test_a_second_run_loads_its_programs_from_the_compilation_cache(tmp_path, env_cpu):
    """Two fresh processes, one cache directory: the first compiles, the second compiles nothing,
    loads every step program untraced from cbjax's program cache, and generates the same tokens."""
    summaries, tokens = [], []
    for run in ("cold", "warm", "jax_cache_only", "again"):
        if run == "jax_cache_only":  # programs only in jax's own cache: used, but never re-stored
            shutil.rmtree(tmp_path / "cache" / programs.SUBDIR)
        out = tmp_path / run
        cmd = cbjax_cmd() + [
            "executor=jax", "scheduler.max_num_seqs=2", "scheduler.max_num_batched_tokens=16",
            "model.max_model_len=32", "workload.num_requests=3", "workload.prompt_len.low=2", "workload.prompt_len.high=8",
            "workload.output_len.max=4", f"executor.compilation_cache_dir={tmp_path / 'cache'}",
            "progress=false", f"hydra.run.dir={out}",
        ]  # fmt: skip
        proc = subprocess.run(cmd, env=env_cpu, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert "Resetting cache" not in proc.stdout + proc.stderr  # jax's INFO log stays off the console
        summaries.append(json.loads((out / "summary.json").read_text()))
        rows = [json.loads(line) for line in (out / "requests.jsonl").read_text().splitlines()]
        tokens.append({r["request_id"]: r["output_token_ids"] for r in rows})
    cold, warm, jax_only, again = summaries
    assert jax_only["warmup_compiles"] == 0 and jax_only["warmup_programs_loaded"] == 0
    assert not (tmp_path / "cache" / programs.SUBDIR).exists()  # such programs lack their kernels
    assert again["num_finished"] == 3 and again["warmup_compiles"] == 0 and tokens[3] == tokens[0]
    assert cold["warmup_compiles"] >= cold["compiled_programs"] > 0
    assert warm["warmup_compiles"] == 0 and warm["warmup_cache_hits"] >= warm["compiled_programs"]
    assert warm["compiles_after_warmup"] == 0
    assert warm["compiled_programs"] == cold["compiled_programs"] and warm["num_finished"] == 3
    assert cold["warmup_programs_loaded"] == 0 and warm["warmup_programs_loaded"] == len(warm["token_buckets"])
    assert tokens[0] == tokens[1] and all(len(t) > 0 for t in tokens[0].values())


def test_non_finite_logits_end_that_request_with_an_error_and_the_run_goes_on():
    """Token 7's embedding is NaN: every request whose prompt holds it gets non-finite logits and
    ends with finish_reason error; the others generate exactly what they do on a healthy model."""
    reqs = workload(6, wseed=10, max_prompt=12, max_out=8, stagger_s=0.0)
    for req in reqs:
        req.prompt_token_ids = [t if t != 7 else 8 for t in req.prompt_token_ids]
    for req in reqs[::3]:
        req.prompt_token_ids = req.prompt_token_ids + [7]
        req.prompt_len += 1
    healthy, _, _ = run_engine(reqs, num_slots=4)
    llama = Llama(MODEL, seed=0)
    llama.embed_tokens[...] = llama.embed_tokens[...].at[7].set(jnp.nan)
    cache = CacheConfig(num_pages=512, page_size=4)
    sched_cfg = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=BUDGET)
    ex = JaxExecutor(MODEL, cache, sched_cfg, ExecutorConfig(name="jax", token_buckets=BUCKETS), llama=llama)
    sched = Scheduler(sched_cfg, cache, MODEL.max_model_len, validate=ex.validate, vocab_size=MODEL.vocab_size)
    ex.warmup()
    result = serve([fresh(r) for r in reqs], sched, ex)
    out = {r.request_id: r for r in result.requests}
    for i, req in enumerate(reqs):
        got = out[req.request_id]
        if i % 3 == 0:
            assert got.finish_reason is FinishReason.ERROR and got.error == "non-finite logits", req.request_id
        else:
            assert got.finish_reason is FinishReason.LENGTH, req.request_id
            assert got.output_token_ids == healthy[req.request_id].output_token_ids, req.request_id


def test_program_cache_keys_change_with_what_decides_the_program_and_bad_files_are_misses(tmp_path):
    """The key follows attention, shapes and XLA_FLAGS; a truncated file loads as a miss (None)."""
    args = ({"w": jnp.zeros((4, 8))}, jnp.zeros(3, jnp.int32))
    base = programs.program_key("graph", "ragged", args)
    assert base == programs.program_key("graph", "ragged", args)
    assert base != programs.program_key("graph", "reference", args)
    assert base != programs.program_key("graph2", "ragged", args)
    assert base != programs.program_key("graph", "ragged", ({"w": jnp.zeros((4, 9))}, jnp.zeros(3, jnp.int32)))
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("XLA_FLAGS", "--xla_some_other_flag=1")
        assert base != programs.program_key("graph", "ragged", args)
    folder = tmp_path / programs.SUBDIR
    folder.mkdir()
    (folder / f"{base}.bin").write_bytes(b"\x80\x04truncated")
    assert programs.load(str(tmp_path), base, jax.devices()[0]) is None
    assert programs.load(str(tmp_path), "absent", jax.devices()[0]) is None


def test_program_cache_keeps_its_programs_when_only_host_code_changes(tmp_path):
    """Editing a scheduling policy (host code) keeps the source digest, and so the stored
    programs; editing the model, the step or a new module changes it."""
    root = tmp_path / "cbjax"
    for rel in ("runtime/step.py", "model/llama.py", "scheduler/policies.py", "sim/profiled.py", "app/run.py"):
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(f"# {rel}\n")
    digest = programs.source_digest(root)
    for rel in ("scheduler/policies.py", "sim/profiled.py", "app/run.py"):
        (root / rel).write_text("# edited\n")
        programs.source_digest.cache_clear()
        assert programs.source_digest(root) == digest, rel
    for rel in ("runtime/step.py", "model/llama.py", "kernels/new_backend.py"):
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text("# edited or new\n")
        programs.source_digest.cache_clear()
        assert programs.source_digest(root) != digest, rel
        digest = programs.source_digest(root)
    programs.source_digest.cache_clear()
    assert "scheduler" in programs.HOST_ONLY and (programs.ROOT / "runtime" / "step.py").is_file()
