"""The simulator's side of speculative decoding: acceptance models against their closed form,
draws that do not depend on batching, trace replay step by step, and the cost of a verify row
and of a draft model's proposals."""

from __future__ import annotations

import dataclasses

import pytest

from conftest import make_requests
from test_spec_scheduler import MarkovEngine, Recorder, cycle_rule, markov_requests
from cbjax.config import CacheConfig, HardwareConfig, ModelConfig, SchedulerConfig, SpecConfig
from cbjax.config.spec import draft_model_config
from cbjax.core.plan import Schedule, ScheduledRequest
from cbjax.engine.offline import serve
from cbjax.scheduler import Scheduler
from cbjax.sim import SimExecutor, UnitCost
from cbjax.sim.acceptance import SeededAcceptance, TraceAcceptance, make_acceptance
from cbjax.sim.cost import RooflineCost, make_cost_model
from cbjax.spec.trace import read_trace, trace_lines


def scheduler(spec, max_seqs=64, num_pages=4096, prefix=False):
    return Scheduler(
        SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=8192),
        CacheConfig(num_pages=num_pages, page_size=16, prefix_caching=prefix), 8192, spec=spec,
    )  # fmt: skip


def full_verifications(reqs, k):
    """Tokens yielded (accepted + 1) by each verification of the full k drafts."""
    return [a + 1 for r in reqs for p, a in r.spec_steps if p == k]


@pytest.mark.parametrize("rate,k", [(0.5, 3), (0.8, 5), (0.3, 1), (0.9, 2)])
def test_mean_tokens_per_verification_is_the_closed_form_within_one_percent(rate, k):
    spec = SpecConfig(method="draft", draft_layers=1, num_tokens=k, acceptance_rate=rate)
    reqs = make_requests([400] * 150, prompt_lens=[32] * 150)
    serve(reqs, scheduler(spec), SimExecutor(UnitCost(), acceptance=make_acceptance(spec, seed=11)))
    got = full_verifications(reqs, k)
    assert len(got) >= 10_000
    closed = (1 - rate ** (k + 1)) / (1 - rate)
    assert sum(got) / len(got) == pytest.approx(closed, rel=0.01)


def test_per_position_rates_hold_each_position_and_repeat_the_last():
    # k = 3 at rates 0.9, 0.5 (then 0.5): 1 + 0.9 + 0.9 * 0.5 + 0.9 * 0.5 * 0.5 = 2.575
    spec = SpecConfig(method="ngram", num_tokens=3, acceptance="per_position", acceptance_rates=[0.9, 0.5])
    reqs = make_requests([400] * 120, prompt_lens=[16] * 120)
    serve(reqs, scheduler(spec), SimExecutor(UnitCost(), acceptance=make_acceptance(spec, seed=5)))
    got = full_verifications(reqs, 3)
    assert len(got) >= 10_000
    assert sum(got) / len(got) == pytest.approx(2.575, rel=0.01)
    first = [a >= 1 for r in reqs for p, a in r.spec_steps if p == 3]
    assert sum(first) / len(first) == pytest.approx(0.9, rel=0.01)


def test_a_requests_acceptances_do_not_depend_on_what_it_is_batched_with():
    spec = SpecConfig(method="ngram", num_tokens=4, acceptance_rate=0.6)

    def steps_of_request_0(n):
        reqs = make_requests([60] * n, arrivals=[0.0] + [0.5 * i for i in range(1, n)])
        serve(reqs, scheduler(spec), SimExecutor(UnitCost(), acceptance=make_acceptance(spec, seed=2)))
        return reqs[0].spec_steps

    alone = steps_of_request_0(1)
    assert alone == steps_of_request_0(20)
    assert any(0 < a < p for p, a in alone)
    # another seed draws otherwise
    other = make_requests([60])
    serve(other, scheduler(spec), SimExecutor(UnitCost(), acceptance=make_acceptance(spec, seed=3)))
    assert other[0].spec_steps != alone


def replay(reqs, spec, trace_path, num_pages=40):
    """`reqs` run again in the simulator on the unit cost model, acceptances from `trace_path`."""
    traced = dataclasses.replace(spec, acceptance="trace", acceptance_path=str(trace_path))
    rec = Recorder()
    sched = scheduler(traced, max_seqs=8, num_pages=num_pages)
    result = serve(reqs, sched, SimExecutor(UnitCost(), acceptance=make_acceptance(traced)), on_step=rec)
    return result, rec


def test_a_run_fed_its_own_trace_makes_the_same_iterations_step_by_step(tmp_path):
    spec = SpecConfig(method="ngram", num_tokens=4, acceptance_rate=0.55)
    lengths, prompts = [25, 7, 40, 18, 33, 12] * 5, [30, 9, 60, 17, 44, 5] * 5
    arrivals = [0.7 * i for i in range(30)]
    rec = Recorder()
    first = make_requests(lengths, prompts, arrivals)
    sched = scheduler(spec, max_seqs=8, num_pages=16)  # a tight pool: preemptions too
    result = serve(first, sched, SimExecutor(UnitCost(), acceptance=make_acceptance(spec, seed=9)), on_step=rec)
    assert sched.num_preemptions > 0
    path = tmp_path / "spec_trace.jsonl"
    path.write_text("".join(line + "\n" for line in trace_lines(first)))
    again, rec2 = replay(make_requests(lengths, prompts, arrivals), spec, path, num_pages=16)
    assert rec2.steps == rec.steps and again.stats.iterations == result.stats.iterations


def test_an_engine_runs_trace_drives_the_simulator_through_the_engines_iterations(tmp_path):
    # an n-gram run on a token-reading executor proposes fewer than k drafts where the lookup
    # finds less (or nothing): the trace carries what it proposed, and the simulator, which has
    # no ids, proposes exactly that
    spec = SpecConfig(method="ngram", num_tokens=4, ngram_min=1, ngram_max=2)
    reqs = markov_requests(n=5, output_len=30)
    for r in reqs[1::2]:
        r.prompt_token_ids = [9, 8, 7, 6, 5, 4, 3, 2, 1, 0]  # another start: other proposals
    rec = Recorder()
    sched = scheduler(spec, max_seqs=8, num_pages=40)
    engine = serve(reqs, sched, MarkovEngine(cycle_rule), on_step=rec)
    steps = [s for r in reqs for s in r.spec_steps]
    assert any(0 < p < 4 for p, _ in steps) and any(a < p for p, a in steps)
    path = tmp_path / "spec_trace.jsonl"
    path.write_text("".join(line + "\n" for line in trace_lines(reqs)))
    sim_reqs = make_requests([30] * 5, [10] * 5, [float(i) for i in range(5)])
    sim, rec2 = replay(sim_reqs, spec, path)
    assert rec2.steps == rec.steps and sim.stats.iterations == engine.stats.iterations
    assert [r.finish_s for r in sim_reqs] == [r.finish_s for r in reqs]


def test_the_trace_file_is_read_back_and_bad_lines_name_the_path(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text('{"request_id": "a", "proposed": [3, 0, 2], "accepted": [1, 0, 2]}\n')
    trace = read_trace(str(path))
    assert trace["a"].at(0) == (3, 1) and trace["a"].at(2) == (2, 2) and trace["a"].at(3) == (0, 0)
    model = TraceAcceptance(trace)
    assert [model.accepted("a", j, d) for j, d in ((0, 3), (0, 0), (2, 1), (5, 3))] == [1, 0, 1, 0]
    assert model.accepted("zzz", 0, 3) == 0
    path.write_text('{"request_id": "a", "proposed": [1], "accepted": [2]}\n')
    with pytest.raises(ValueError, match=r"spec\.acceptance_path: .*t\.jsonl line 1: proposed and accepted"):
        read_trace(str(path))
    with pytest.raises(ValueError, match=r"spec\.acceptance_path: no acceptance trace at"):
        read_trace(str(tmp_path / "missing.jsonl"))


def test_seeded_acceptance_is_the_first_rejection_of_independent_draws():
    never, always = SeededAcceptance([0.0]), SeededAcceptance([1.0])
    assert [never.accepted("r", j, 5) for j in range(20)] == [0] * 20
    assert [always.accepted("r", j, 5) for j in range(20)] == [5] * 20
    half = SeededAcceptance([0.5], seed=1)
    assert half.accepted("r", 3, 4) == half.accepted("r", 3, 4)
    assert {half.accepted("r", j, 4) for j in range(200)} == {0, 1, 2, 3, 4}


def verify_plan(d, context=1000, rows=1):
    scheduled = [ScheduledRequest(str(i), i, context, 1 + d, True, num_drafts=d) for i in range(rows)]
    return Schedule(num_slots=rows, scheduled=scheduled, page_size=16)


def test_a_verify_row_streams_the_weights_once_and_charges_its_tokens_each():
    model, hw = ModelConfig(name="m", vocab_size=1000, d_model=512, num_layers=4, num_heads=8, num_kv_heads=8,
                            head_dim=64, ffn_dim=1024, dtype="bfloat16"), HardwareConfig()  # fmt: skip
    cost = RooflineCost(model, hw, verify=True)
    head = 2.0 * model.vocab_size * model.d_model
    body = 2.0 * (model.num_params - 2 * model.vocab_size * model.d_model)
    attn = 4.0 * model.num_layers * model.num_heads * model.head_dim
    for d in (0, 3):
        n, ctx = 1 + d, 1000
        flops = n * body + n * head + (n * ctx + n * (n + 1) / 2) * attn  # the head at every position
        bytes_moved = model.num_params * 2 + (ctx + n + 1) * model.kv_bytes_per_token  # weights once
        want = max(flops / (hw.peak_flops * hw.flops_efficiency), bytes_moved / (hw.mem_bw * hw.bw_efficiency))
        assert cost(verify_plan(d)).device_s == pytest.approx(want, rel=1e-12)
    # memory-bound: 3 drafts cost a few per cent more than none, not 4x
    assert cost(verify_plan(3)).device_s < 1.1 * cost(verify_plan(0)).device_s
    # without speculation the head runs once per row, as before
    assert RooflineCost(model, hw)(verify_plan(0)).device_s == cost(verify_plan(0)).device_s


def test_a_stacks_overhead_keeps_the_pipelined_parts_of_the_steps_time():
    # a stack over another model adds its host time (0.5 a step here) to the step and to its
    # drain, and keeps the launch, the collect share and the held launch's extra as priced
    from cbjax.config import OverheadConfig
    from cbjax.core.timing import StepTime
    from cbjax.sim.cost import WithOverhead

    priced = StepTime(1.0, 0.05, 0.0, 0.1, 0.5, 0.0, 0.0, 0.25, 0.75)

    class Fixed:
        name, history = "fixed", 0

        def __call__(self, plan, ctx=None):
            return priced

    cost = WithOverhead(Fixed(), ModelConfig(), OverheadConfig(step_s=0.5))
    t = cost(Schedule(num_slots=1, scheduled=[ScheduledRequest("a", 0, 100, 1, True)], page_size=16))
    assert t == StepTime(1.0, 0.55, 0.0, 0.1, 1.0, 0.0, 0.0, 0.25, 0.75)


def test_a_draft_models_proposals_keep_every_other_part_of_the_steps_time():
    # the wrapped model prices a step 1.0 on the device, 0.5 drained, with host-tier copies
    # (0.3, 0.2 of it loads), a 0.4 prefetch beside it, a 0.1 launch and a 0.25 collect share;
    # two proposal steps of 0.75 each add 1.5 to the device and the drain alone
    from cbjax.core.timing import StepTime
    from cbjax.sim.drafting import WithDraftModel

    priced = StepTime(1.0, 0.05, 0.3, 0.1, 0.5, 0.2, 0.4, 0.25)

    class Fixed:
        name, history = "fixed", 0

        def __call__(self, plan, ctx=None):
            return priced

    cost = WithDraftModel(Fixed(), lambda step: 0.75)
    rows = [ScheduledRequest("a", 0, 100, 3, True, num_drafts=2)]
    t = cost(Schedule(num_slots=1, scheduled=rows, page_size=16))
    assert t == StepTime(2.5, 0.05, 0.3, 0.1, 2.0, 0.2, 0.4, 0.25)
    assert cost(Schedule(num_slots=1, scheduled=[ScheduledRequest("a", 0, 100, 1, True)], page_size=16)) is priced


def test_a_draft_models_proposals_are_charged_as_its_own_decode_steps():
    target = ModelConfig(name="t", vocab_size=1000, d_model=512, num_layers=8, num_heads=8, num_kv_heads=8,
                         head_dim=64, ffn_dim=1024, dtype="bfloat16")  # fmt: skip
    hw = HardwareConfig()
    spec = SpecConfig(method="draft", draft_layers=2, num_tokens=3)
    draft = draft_model_config(spec, target)
    assert (draft.num_layers, draft.vocab_size, draft.d_model) == (2, 1000, 512)
    cost = make_cost_model("roofline", target, hw, spec=spec)
    plain = RooflineCost(target, hw, verify=True)
    draft_cost = RooflineCost(draft, hw)
    rows = [ScheduledRequest("a", 0, 100, 4, True, num_drafts=3), ScheduledRequest("b", 1, 50, 2, True, num_drafts=1),
            ScheduledRequest("c", 2, 70, 1, True)]  # fmt: skip
    plan = Schedule(num_slots=3, scheduled=rows, page_size=16)
    # draft step 0: a at 100 and b at 50; steps 1 and 2: a at 101, 102
    steps = [[("a", 100), ("b", 50)], [("a", 101)], [("a", 102)]]
    want = plain(plan).device_s + sum(
        draft_cost(Schedule(num_slots=3, scheduled=[ScheduledRequest(r, 0, c, 1, True) for r, c in step],
                            page_size=16)).device_s for step in steps
    )  # fmt: skip
    assert cost(plan).device_s == pytest.approx(want, rel=1e-12)
    no_drafts = Schedule(num_slots=3, scheduled=[rows[2]], page_size=16)
    assert cost(no_drafts).device_s == plain(no_drafts).device_s


def test_a_separate_draft_model_runs_every_steps_batch_then_one_pass_per_draft():
    # the engine's separate draft model (cbjax.runtime.draft) first runs the step's whole batch,
    # drafts aside, so that its own K/V holds every token the target's does (prompts too), then
    # pass j = 1 .. d over draft j at num_computed + j, the last only writing draft d's K/V
    from cbjax.config.spec import load_draft_model

    target, draft = load_draft_model("llama3_8b"), load_draft_model("llama32_1b")
    hw = HardwareConfig()
    spec = SpecConfig(method="draft", draft_model="llama32_1b", num_tokens=3)
    cost = make_cost_model("roofline", target, hw, spec=spec)
    plain, draft_cost = RooflineCost(target, hw, verify=True), RooflineCost(draft, hw)

    def draft_s(*steps):
        return sum(draft_cost(Schedule(num_slots=4, scheduled=list(step), page_size=16)).device_s for step in steps)

    prefill = ScheduledRequest("p", 3, 0, 10, False)
    rows = [ScheduledRequest("a", 0, 100, 4, True, num_drafts=3), ScheduledRequest("b", 1, 50, 2, True, num_drafts=1),
            ScheduledRequest("c", 2, 70, 1, True), prefill]  # fmt: skip
    plan = Schedule(num_slots=4, scheduled=rows, page_size=16)
    passes = draft_s(
        [ScheduledRequest("a", 0, 100, 1, True), ScheduledRequest("b", 1, 50, 1, True),
         ScheduledRequest("c", 2, 70, 1, True), prefill],
        [ScheduledRequest("a", 0, 101, 1, True), ScheduledRequest("b", 1, 51, 1, True)],
        [ScheduledRequest("a", 0, 102, 1, True)],
        [ScheduledRequest("a", 0, 103, 1, True)],
    )  # fmt: skip
    assert cost(plan).device_s == pytest.approx(plain(plan).device_s + passes, rel=1e-12)
    # a step without drafts still runs its batch through the draft model
    no_drafts = Schedule(num_slots=4, scheduled=[rows[2], prefill], page_size=16)
    assert cost(no_drafts).device_s == pytest.approx(plain(no_drafts).device_s + draft_s([rows[2], prefill]), rel=1e-12)


def test_a_separate_draft_models_weights_and_kv_come_out_of_the_pool():
    from cbjax.app.run import resolve
    from cbjax.cache.sizing import auto_num_pages
    from cbjax.config import RunConfig
    from cbjax.config.spec import load_draft_model

    target, draft = load_draft_model("llama3_8b"), load_draft_model("llama32_1b")
    hw = HardwareConfig(mem_bytes=80e9)
    weights = target.num_params * 2 + draft.num_params * 2
    page = (target.kv_bytes_per_token + draft.kv_bytes_per_token) * 16
    assert auto_num_pages(target, hw, 16, 0.9, draft) == int((80e9 * 0.9 - weights) // page)
    cfg = RunConfig(model=target, hardware=hw, cache=CacheConfig(num_pages="auto"))
    alone = resolve(cfg).cache.num_pages
    drafted = resolve(dataclasses.replace(cfg, spec=SpecConfig(method="draft", draft_model="llama32_1b"))).cache.num_pages
    assert drafted == auto_num_pages(target, hw, 16, 0.9, draft) < alone
    # a draft of the target's own layers shares its weights and K/V
    layers = resolve(dataclasses.replace(cfg, spec=SpecConfig(method="draft", draft_layers=4))).cache.num_pages
    assert layers == alone


def test_a_speculating_profile_times_verify_steps_and_the_default_grid_is_unchanged():
    from cbjax.layout.shapes import plan_shapes
    from cbjax.profile.grid import build_schedule, profile_grid

    shapes = plan_shapes(num_rows=32, max_model_len=256, page_size=8, max_num_batched_tokens=512)
    plain = profile_grid(shapes, 256, "full")
    assert profile_grid(shapes, 256, "full", spec_tokens=0) == plain
    assert {p.kind for p in plain} == {"decode", "prefill", "chunk", "mixed"}
    spec = profile_grid(shapes, 256, "full", spec_tokens=4)
    verify = [p for p in spec if p.kind == "verify"]
    assert [p for p in spec if p.kind != "verify"] == plain
    assert {n for p in verify for n, _ in p.rows} == {2, 5}  # 1 and 4 drafts
    assert max(len(p.rows) for p in verify) == 32 and all(sum(n for n, _ in p.rows) <= 512 for p in verify)
    plan = build_schedule(verify[-1], shapes, 2048, 512)
    assert all(s.is_decode and s.num_drafts == s.num_new_tokens - 1 == 4 for s in plan.scheduled)
    assert all(len(s.token_ids) == s.num_new_tokens for s in plan.scheduled)  # host drafts: ids in the row


def test_a_simulated_cluster_speculates_on_every_replica():
    from cbjax.app.run import run_single
    from cbjax.config import ClusterConfig, RunConfig, WorkloadConfig

    spec = SpecConfig(method="ngram", num_tokens=3, acceptance_rate=0.6)
    base = RunConfig(progress=False, workload=WorkloadConfig(num_requests=30), spec=spec)
    for cluster in (ClusterConfig(replicas=2), ClusterConfig(prefill_replicas=1, decode_replicas=1)):
        cfg = dataclasses.replace(base, cluster=cluster)
        on = run_single(cfg, verbose=False)
        off = run_single(dataclasses.replace(cfg, spec=SpecConfig()), verbose=False)
        assert on["spec_proposed_tokens"] > 0 and 0 < on["spec_acceptance_rate"] < 1
        assert on["output_tokens"] == off["output_tokens"] and on["num_finished"] == 30
