"""Multi-turn sessions: each later turn arrives a pause after the turn before it ends (hand-
computed on the unit cost model), its prompt the conversation so far; a failed turn rejects the
session's later turns by name; a stopped run gives every turn a row; the simulated and engine
clusters serve sessions; the simulator and the engine find the same prefix pages."""

from __future__ import annotations

import dataclasses
import json
import math
from collections import deque

import numpy as np

import pytest

import fake_replica
from conftest import ContentCheckingExecutor
from cbjax.app.run import run_single
from cbjax.cluster import ClusterSim
from cbjax.cluster.engine import ClusterEngine
from cbjax.config import (
    CacheConfig,
    ClusterConfig,
    LengthConfig,
    PauseConfig,
    RunConfig,
    SchedulerConfig,
    WorkloadConfig,
)
from cbjax.core.request import FinishReason, Request, SamplingParams
from cbjax.engine.followups import Followups
from cbjax.engine.offline import serve
from cbjax.report.metrics import request_row, summarize
from cbjax.report.tables import summary_value
from cbjax.scheduler.core import Scheduler
from cbjax.sim import SimExecutor
from cbjax.sim.cost import UnitCost
from cbjax.workload import build_workload

VOCAB = 512


def turn(session: str, k: int, new: int, out: int, *, arrival: float = math.inf, pause=None, last=False, seed=None):
    """Turn k of `session`: `new` new input tokens, `out` output tokens; turn 0 arrives at
    `arrival`, a later one `pause` after the turn before it ends."""
    return Request(
        f"{session}.{k}", arrival, new, synthetic_prompt=(seed if seed is not None else ord(session[0]), VOCAB),
        sampling=SamplingParams(max_tokens=out, ignore_eos=True), target_output_len=out,
        session_id=session, turn=k, more_turns=not last, pause_s=pause,
    )  # fmt: skip


def three_sessions():
    return [
        turn("A", 0, 4, 2, arrival=0.0), turn("A", 1, 3, 1, pause=0.5), turn("A", 2, 2, 3, pause=2.0, last=True),
        turn("B", 0, 5, 3, arrival=1.0), turn("B", 1, 2, 2, pause=0.0, last=True),
        turn("C", 0, 3, 1, arrival=2.5), turn("C", 1, 2, 2, pause=1.0, last=True),
    ]  # fmt: skip


def scheduler(max_model_len=256, num_pages=256, page_size=4, prefix_caching=True):
    return Scheduler(
        SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=512),
        CacheConfig(num_pages=num_pages, page_size=page_size, prefix_caching=prefix_caching),
        max_model_len,
    )


def test_each_later_turn_arrives_its_pause_after_the_turn_before_ends_by_hand():
    # unit cost: every iteration 1 s; a request of L tokens prefills in one iteration (its
    # first token) and ends with its L-th. Iterations: [0,1) A0 prefill; [1,2) A0 ends, B0
    # prefill; [2,3) B0; [3,4) A1 and C0 (both arrived 2.5) prefill and end, B0 ends; then
    # B1 arrives at 4 + 0, C1 at 4 + 1, A2 at 4 + 2; [4,5) B1; [5,6) B1 ends, C1; [6,7) C1
    # ends, A2; [7,9) A2.
    reqs = three_sessions()
    result = serve(reqs, scheduler(), SimExecutor(UnitCost()))
    got = {r.request_id: (r.arrival_s, r.finish_s, r.prompt_len) for r in result.requests}
    assert got == {
        "A.0": (0.0, 2.0, 4), "A.1": (2.5, 4.0, 4 + 2 + 3), "A.2": (6.0, 9.0, 9 + 1 + 2),
        "B.0": (1.0, 4.0, 5), "B.1": (4.0, 6.0, 5 + 3 + 2),
        "C.0": (2.5, 4.0, 3), "C.1": (5.0, 7.0, 3 + 1 + 2),
    }  # fmt: skip
    assert {r.finish_reason for r in reqs} == {FinishReason.LENGTH}
    # the conversation is the session's one seeded stream
    assert all(r.synthetic_prompt == (ord(r.session_id), VOCAB) and r.prompt_token_ids is None for r in reqs)
    rows = {r.request_id: request_row(r) for r in reqs}
    assert (rows["A.2"]["session_id"], rows["A.2"]["turn"]) == ("A", 2)
    summary = summarize(result)
    # TTFT = first token's end - arrival: turn 0 A 1, B 1, C 1.5 (2.5 to 4); turn 1 A 1.5, B 1,
    # C 1; turn 2 A 1
    assert summary["ttft_s_p50_by_turn"] == [1.0, 1.0, 1.0]
    assert summary["ttft_s_p99_by_turn"] == [pytest.approx(1.49), pytest.approx(1.49), 1.0]
    assert summary["ttft_s_mean_by_turn"] == [3.5 / 3, 3.5 / 3, 1.0]
    assert summary["served_by_turn"] == [3, 3, 1]
    # prompt tokens over summed TTFT: turn 0 (4 + 5 + 3) / 3.5, turn 1 (9 + 10 + 6) / 3.5, turn 2 12 / 1
    assert summary["prefill_tok_s_by_turn"] == [12 / 3.5, 25 / 3.5, 12.0]
    assert summary["prefill_tok_s"] == (12 + 25 + 12) / 8.0
    assert summary_value(summary, "ttft_s_p50_by_turn.2") == 1.0  # comparison tables read a turn's
    assert summary_value(summary, "ttft_s_p50_by_turn.3") is None


def long_request(arrival: float, out: int) -> Request:
    return Request("R", arrival, 4, synthetic_prompt=(99, VOCAB), sampling=SamplingParams(max_tokens=out, ignore_eos=True),
                   target_output_len=out)  # fmt: skip


def test_a_released_turn_joins_the_next_iteration_even_during_a_decode_stretch():
    # [0,1): A0 and R prefill, A0 ends; A1 arrives at 1 + 0 and prefills in [1,2) beside R's
    # decode, ends at 3; R decodes alone until its 10th token at 10. Were the loop to go on
    # with R's stretch, A1 would wait until 10.
    reqs = [turn("A", 0, 4, 1, arrival=0.0), turn("A", 1, 2, 2, pause=0.0, last=True), long_request(0.0, 10)]
    serve(reqs, scheduler(), SimExecutor(UnitCost()))
    a1, r = reqs[1], reqs[2]
    assert (a1.arrival_s, a1.first_token_s, a1.finish_s, a1.prompt_len) == (1.0, 2.0, 3.0, 4 + 1 + 2)
    assert r.finish_s == 10.0


def test_a_replica_never_runs_past_a_turn_another_replica_may_send_it():
    # round robin: R -> replica 0, A0 (at 0.2) -> 1, A1 -> 0. Replica 0: [0,1) R's prefill,
    # [1,2), [2,3) R's decodes; replica 1: [0.2,1.2) A0's prefill, [1.2,2.2) its decode: A0
    # ends at 2.2 and A1 arrives at replica 0 then, which prefills it in [3,4). A decode
    # stretch of R from 1 would have kept A1 waiting until R's end at 10.
    cfg = RunConfig(
        cluster=ClusterConfig(replicas=2, router="round_robin"),
        scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=1024),
        cache=CacheConfig(num_pages=256, page_size=16), progress=False,  # R's decodes need no new page
    )  # fmt: skip
    reqs = [long_request(0.0, 10), turn("A", 0, 4, 2, arrival=0.2), turn("A", 1, 2, 2, pause=0.0, last=True)]
    cluster = ClusterSim(cfg, lambda c: SimExecutor(UnitCost()))
    cluster.serve(reqs)
    r, a0, a1 = reqs
    assert [cluster.row_extras(q)["replica"] for q in reqs] == [0, 1, 0]
    assert a0.finish_s == pytest.approx(2.2) and a1.arrival_s == pytest.approx(2.2)
    assert (a1.first_token_s, a1.finish_s, r.finish_s) == (4.0, 5.0, 10.0)


def test_a_run_without_sessions_has_no_ttft_by_turn():
    reqs = [
        Request("0", 0.0, 8, synthetic_prompt=(1, VOCAB), sampling=SamplingParams(max_tokens=2), target_output_len=2)
    ]
    summary = summarize(serve(reqs, scheduler(), SimExecutor(UnitCost())))
    assert summary["ttft_s_p50_by_turn"] is None and summary["served_by_turn"] is None
    assert summary["prefill_tok_s_by_turn"] is None and summary["prefill_tok_s"] is None
    assert request_row(reqs[0])["session_id"] is None and request_row(reqs[0])["turn"] == 0


def test_a_failed_turn_rejects_the_sessions_later_turns_naming_it_and_the_run_goes_on():
    # max_model_len 16: A1's conversation is 4 + 2 + 12 = 18 tokens, rejected at its arrival
    # (2 + 0.5); A2 follows at once, rejected naming A1; B is served.
    reqs = [
        turn("A", 0, 4, 2, arrival=0.0), turn("A", 1, 12, 1, pause=0.5), turn("A", 2, 2, 1, pause=9.0, last=True),
        turn("B", 0, 5, 2, arrival=0.0), turn("B", 1, 2, 2, pause=0.0, last=True),
    ]  # fmt: skip
    result = serve(reqs, scheduler(max_model_len=16), SimExecutor(UnitCost()))
    fates = {r.request_id: r.finish_reason for r in result.requests}
    assert fates == {"A.0": FinishReason.LENGTH, "A.1": FinishReason.REJECTED, "A.2": FinishReason.REJECTED,
                     "B.0": FinishReason.LENGTH, "B.1": FinishReason.LENGTH}  # fmt: skip
    a1, a2 = reqs[1], reqs[2]
    assert a1.reject_reason == "prompt has 18 tokens, model max_model_len is 16 (no room to generate)"
    assert a2.reject_reason == (f"session A: turn 1 ended rejected ({a1.reject_reason}), so turn 2 was never sent")
    assert a1.arrival_s == a1.finish_s == a2.arrival_s == a2.finish_s == 2.5


def _stop_after(checks: int):
    class Stop:
        def __init__(self):
            self.left = checks

        def is_set(self):
            self.left -= 1
            return self.left < 0

    return Stop()


def test_a_stop_mid_run_leaves_every_turn_with_a_row(tmp_path):
    workload = WorkloadConfig(
        name="sessions", num_sessions=4, arrival="uniform", rate=1.0, turns=LengthConfig(dist="fixed", value=3),
        prompt_len=LengthConfig(dist="fixed", value=8), output_len=LengthConfig(dist="fixed", value=4, max=4),
        pause=PauseConfig(dist="fixed", value=2.0),
    )  # fmt: skip
    cfg = RunConfig(workload=workload, progress=False)
    cfg = dataclasses.replace(cfg, executor=dataclasses.replace(cfg.executor, cost_model="unit"))
    summary = run_single(cfg, tmp_path, verbose=False, stop=_stop_after(8))
    rows = [json.loads(line) for line in (tmp_path / "requests.jsonl").read_text().splitlines()]
    assert summary["interrupted"] and summary["num_requests"] == len(rows) == 12
    assert sorted(r["request_id"] for r in rows) == sorted(f"{s}.{k}" for s in range(4) for k in range(3))
    fates = {r["request_id"]: r["finish_reason"] for r in rows}
    assert set(fates.values()) == {"length", "aborted", "not_arrived"}
    stopped_at = max(r["finish_s"] for r in rows if r["finish_s"] is not None)
    unsent = [r for r in rows if r["finish_reason"] == "not_arrived" and r["arrival_s"] is None]
    assert unsent and all(r["turn"] > 0 and r["finish_s"] is None for r in unsent)  # never released
    # released, but due after the stop
    assert all(r["arrival_s"] > stopped_at for r in rows if r["finish_reason"] == "not_arrived" and r not in unsent)
    assert all(fates[f"{s}.0"] != "not_arrived" or fates[f"{s}.1"] == "not_arrived" for s in range(4))


def test_the_sessions_workload_is_seeded_and_holds_its_later_turns():
    cfg = WorkloadConfig(name="sessions", num_sessions=3, turns=LengthConfig(dist="uniform", low=1, high=4),
                         pause=PauseConfig(dist="pareto", mean=2.0, alpha=1.5))  # fmt: skip
    reqs = build_workload(cfg, seed=7)
    again = build_workload(cfg, seed=7)
    assert [(r.request_id, r.arrival_s, r.prompt_len, r.pause_s) for r in reqs] == [
        (r.request_id, r.arrival_s, r.prompt_len, r.pause_s) for r in again
    ]
    for r in reqs:
        session, k = r.request_id.split(".")
        assert (r.session_id, r.turn) == (session, int(k))
        assert (r.pause_s is None) == (k == "0") and (math.isinf(r.arrival_s)) == (k != "0")
        assert r.pause_s is None or r.pause_s >= 2.0 * 0.5 / 1.5  # a pareto draw is at least its scale
        assert r.synthetic_prompt == next(q for q in reqs if q.request_id == f"{session}.0").synthetic_prompt
    last = {}
    for r in reqs:
        last[r.session_id] = r
    assert all(not r.more_turns for r in last.values()) and sum(r.more_turns for r in reqs) == len(reqs) - 3
    assert build_workload(cfg, seed=8)[0].synthetic_prompt != reqs[0].synthetic_prompt


def test_a_later_turn_without_the_turn_before_it_fails_naming_both():
    reqs = [turn("A", 0, 4, 1, arrival=0.0), turn("A", 2, 1, 1, pause=1.0)]
    with pytest.raises(ValueError, match=r"request A.2: turn 2 of session 'A' follows turn 1, which is not among"):
        Followups(reqs, reqs[1:], deque())


def test_the_simulated_cluster_serves_sessions_and_each_turn_gets_a_row():
    cfg = RunConfig(
        cluster=ClusterConfig(replicas=2, router="prefix_affinity"),
        scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=1024),
        cache=CacheConfig(num_pages=256, page_size=4), progress=False,
    )  # fmt: skip
    reqs = three_sessions()
    cluster = ClusterSim(cfg, lambda c: SimExecutor(UnitCost()))
    result = cluster.serve(reqs)
    assert {r.finish_reason for r in result.requests} == {FinishReason.LENGTH} and len(result.requests) == 7
    for r in reqs:
        prev = next((q for q in reqs if (q.session_id, q.turn) == (r.session_id, r.turn - 1)), None)
        if prev is not None:
            assert r.arrival_s == prev.finish_s + r.pause_s
            # prefix affinity sends a session's turns where its earlier prompt is cached
            assert cluster.row_extras(r)["replica"] == cluster.row_extras(prev)["replica"]


def test_the_engine_cluster_builds_each_turns_prompt_from_the_ids_before_it():
    # stand-in engine replicas (tests/fake_replica.py): real token ids, the wall clock
    cfg = fake_replica.config("inline", replicas=2)
    reqs = [
        turn("A", 0, 4, 2, arrival=0.0, seed=11), turn("A", 1, 3, 2, pause=0.0, seed=11),
        turn("A", 2, 2, 1, pause=0.01, last=True, seed=11), turn("B", 0, 5, 1, arrival=0.0, seed=12),
        turn("B", 1, 2, 1, pause=0.0, last=True, seed=12),
    ]  # fmt: skip
    for r in reqs:
        r.synthetic_prompt = (r.synthetic_prompt[0], 50)
    result = ClusterEngine(cfg, fake_replica.build).serve(reqs)
    assert [r.finish_reason for r in result.requests] == [FinishReason.LENGTH] * 5
    a0, a1, a2 = reqs[:3]
    assert len(a0.output_token_ids) == 2 and a1.prompt_len == 4 + 2 + 3 and a2.prompt_len == 9 + 2 + 2
    assert a1.prompt_token_ids[:6] == a0.prompt_ids() + a0.output_token_ids
    assert a2.prompt_token_ids[:11] == a1.prompt_token_ids + a1.output_token_ids
    # the new input continues the session's seeded stream at its positions
    stream = np.random.default_rng(11).integers(0, 50, size=13).tolist()
    assert a1.prompt_token_ids[6:] == stream[6:9] and a2.prompt_token_ids[11:] == stream[11:13]
    assert a1.arrival_s >= a0.finish_s and a2.arrival_s >= a1.finish_s + 0.01


def _hits(reqs, executor, page_size=4):
    sched = Scheduler(
        SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64),
        CacheConfig(num_pages=128, page_size=page_size, prefix_caching=True), 128, vocab_size=VOCAB,
    )  # fmt: skip
    result = serve(reqs, sched, executor)
    assert {r.finish_reason for r in result.requests} == {FinishReason.LENGTH}
    return sched.prefix.prompt_tokens_hit, sched.prefix.tokens_hit


def hit_sessions():
    return [
        turn("A", 0, 6, 3, arrival=0.0), turn("A", 1, 5, 2, pause=0.0), turn("A", 2, 3, 2, pause=0.0, last=True),
        turn("B", 0, 8, 2, arrival=0.0), turn("B", 1, 4, 1, pause=0.0, last=True),
    ]  # fmt: skip


# Pages of 4. A0 (6 + 3) computes 8 tokens: 2 full pages, its prompt and first 2 outputs.
# A1 (6 + 3 + 5 = 14) hits them (8), computes 15 after its 2 outputs: 3 pages. A2 (14 + 2 + 3
# = 19) hits 3 pages (12). B0 (8 + 2) computes 9: 2 pages; B1 (8 + 2 + 4 = 14) hits them (8).
HITS = 8 + 12 + 8


def test_the_simulator_hits_a_turns_output_pages_as_the_content_does():
    assert _hits(hit_sessions(), SimExecutor(UnitCost())) == (HITS, HITS)
    # an executor that makes real ids and checks every cached page's contents: the same hits
    sched = Scheduler(
        SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64),
        CacheConfig(num_pages=128, page_size=4, prefix_caching=True), 128, vocab_size=VOCAB,
    )  # fmt: skip
    result = serve(hit_sessions(), sched, ContentCheckingExecutor(sched, tokens=True))
    assert {r.finish_reason for r in result.requests} == {FinishReason.LENGTH}
    assert sched.prefix.prompt_tokens_hit == HITS


def test_the_simulator_and_the_engine_find_the_same_prefix_pages():
    pytest.importorskip("jax")
    from cbjax.config import ExecutorConfig, ModelConfig
    from cbjax.runtime.executor import JaxExecutor

    engine = JaxExecutor(
        ModelConfig(max_model_len=128), CacheConfig(num_pages=128, page_size=4, prefix_caching=True),
        SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64), ExecutorConfig(name="jax", token_buckets=[16, 64]),
        seed=0,
    )  # fmt: skip
    engine.warmup(sampling=False)
    engine_hits = _hits(hit_sessions(), engine)
    engine.close()
    assert engine_hits == _hits(hit_sessions(), SimExecutor(UnitCost())) == (HITS, HITS)


def test_cbjax_bench_refuses_turns_that_wait_on_the_server():
    from cbjax.bench.config import BenchConfig
    from cbjax.bench.run import run_bench

    cfg = BenchConfig(workload=WorkloadConfig(name="sessions", num_sessions=2), progress=False)
    with pytest.raises(ValueError, match="cbjax-bench sends every request at a fixed time"):
        run_bench(cfg, verbose=False)
