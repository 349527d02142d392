"""Time has one owner: every cost model is a pure function of (plan, context), and no executor,
driver or cluster changes a plan after the scheduler wrote it."""

from __future__ import annotations

import copy
import dataclasses
import json

import pytest

from conftest import make_plan
from test_profiled import MODEL, configs, decode_and_prefill, only_bucket_costs, write_profile
from cbjax.cluster import ClusterSim
from cbjax.config import CacheConfig, ClusterConfig, ExecutorConfig, HardwareConfig, OverheadConfig, RunConfig
from cbjax.config import LengthConfig, SchedulerConfig, WorkloadConfig
from cbjax.core.request import Request
from cbjax.core.timing import StepContext
from cbjax.app.run import build_executor, run_single
from cbjax.scheduler.core import Scheduler
from cbjax.sim import make_cost_model


def plans():
    """Decodes, a prefill, a mixed step, swaps both ways and a padded static batch."""
    d, p = decode_and_prefill()
    e = Request("e", 0.0, 30)
    e.num_computed, e.num_new_tokens = 17, 1
    return [
        make_plan(num_slots=4, decodes=[d], page_size=4),
        make_plan(num_slots=4, decodes=[d, e], page_size=4),
        make_plan(num_slots=4, prefills=[p], page_size=4),
        make_plan(num_slots=4, decodes=[d, e], prefills=[p], page_size=4),
        make_plan(num_slots=4, decodes=[e], page_size=4, swap_in=[(d, [7, 8])], swap_out=[(p, [1, 2, 3])]),
        make_plan(num_slots=4, decodes=[d], page_size=4, padded_rows=[(1, 4, True), (1, 4, True), (1, 9, True)]),
    ]


CONTEXTS = [
    StepContext(),
    StepContext(in_flight_rows=3),
    StepContext(idle_s=0.4),
    StepContext(recent_tokens=(1, 41, 1, 1)),
    StepContext(in_flight_rows=1, idle_s=2.0, recent_tokens=(41,)),
]


def cost_models(tmp_path):
    """Every built-in cost model, and the profiled one with its CPU terms, launch terms and drain."""
    hw = HardwareConfig(mem_bw=1e12, peak_flops=1e14, host_bw=1e10)
    stack = OverheadConfig(name="test", step_s=1e-3, seq_s=1e-4, page_s=1e-5, copy_latency_s=1e-6)
    coef = only_bucket_costs(
        {"4": 1.0, "16": 2.0, "64": 7.0}, token_s=0.01, loop_s=0.1, loop_seq_s=0.02, wake_s=0.5, cold_s=0.25,
        cold2_s=0.125, launch_iter_s=0.1, launch_left_s=0.05, launch_prefill_s=0.3, drain_s=0.4, swap_iter_s=0.2,
        swap_page_s=0.01,
    )  # fmt: skip
    cfgs = configs(write_profile(tmp_path / "p.json", coef, page_size=4, num_slots=4))
    return {
        "unit": make_cost_model("unit", MODEL, hw),
        "roofline": make_cost_model("roofline", MODEL, hw),
        "roofline+stack": make_cost_model("roofline", MODEL, hw, overhead=stack),
        "profiled": make_cost_model("profiled", MODEL, None, **cfgs),
        "profiled+stack": make_cost_model("profiled", MODEL, None, **cfgs, overhead=stack),
    }


def test_every_cost_model_prices_a_plan_the_same_whatever_came_before(tmp_path):
    calls = [(i, j) for i in range(len(plans())) for j in range(len(CONTEXTS))]
    for name, cost in cost_models(tmp_path).items():
        forward = {(i, j): cost(plans()[i], CONTEXTS[j]) for i, j in calls}
        backward = {(i, j): cost(plans()[i], CONTEXTS[j]) for i, j in reversed(calls)}
        assert forward == backward, name
        # and the same call again, after all of them
        assert cost(plans()[3], CONTEXTS[4]) == forward[(3, 4)], name


def test_the_profiled_model_reads_its_context_and_nothing_else(tmp_path):
    # a sanity check that the context is not ignored (the purity test above would pass on a
    # model that reads nothing): idle, in flight and earlier steps each change the price
    cost = cost_models(tmp_path)["profiled"]
    small = plans()[0]
    base = cost(small)
    assert cost(small, StepContext(idle_s=0.4)).total_s > base.total_s
    assert cost(small, StepContext(recent_tokens=(41,))).total_s > base.total_s
    assert cost(plans()[2], StepContext(in_flight_rows=3)).launch_s > cost(plans()[2]).launch_s


class PlanRecorder:
    """Wraps `Scheduler.schedule` and `schedule_stretch`: keeps each plan and a deep copy taken
    as the scheduler returns it."""

    def __init__(self, monkeypatch):
        self.plans = []
        for name in ("schedule", "schedule_stretch"):
            monkeypatch.setattr(Scheduler, name, self._recording(getattr(Scheduler, name)))

    def _recording(self, real):
        def write(sched, *args):
            plan = real(sched, *args)
            self.plans.append((plan, copy.deepcopy(plan)))
            return plan

        return write

    def check(self) -> int:
        """The steps the plans held (a decode stretch's plan holds several)."""
        assert self.plans
        for plan, written in self.plans:
            assert plan == written, f"plan {written.step_id} changed after it was written"
        return sum(plan.num_steps for plan, _ in self.plans)


def small_run(**kw) -> RunConfig:
    base = dict(
        scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, preemption="swap"),
        cache=CacheConfig(page_size=4, num_pages=24, num_swap_pages=256),
        workload=WorkloadConfig(
            num_requests=24, arrival="poisson", rate=2000.0, prompt_len=LengthConfig(dist="uniform", low=4, high=40),
            output_len=LengthConfig(dist="uniform", low=1, high=40),
        ),
        progress=False,
    )
    base.update(kw)
    return RunConfig(**base)


@pytest.mark.parametrize("cost_model", ["unit", "roofline", "profiled"])
def test_no_plan_changes_after_it_is_written_in_the_simulator(tmp_path, monkeypatch, cost_model):
    recorder = PlanRecorder(monkeypatch)
    if cost_model == "profiled":  # pipelined, on the profile's shapes
        coef = only_bucket_costs({"4": 1e-3, "16": 2e-3, "64": 7e-3}, launch_iter_s=1e-4, drain_s=5e-4)
        executor = configs(write_profile(tmp_path / "p.json", coef, page_size=4, num_slots=4))["executor"]
    else:
        executor = ExecutorConfig(name="sim", cost_model=cost_model)
    summary = run_single(small_run(executor=executor), verbose=False)
    assert summary["num_finished"] == 24 and summary["preemptions"] > 0  # swaps were planned
    assert recorder.check() == summary["iterations"]


@pytest.mark.parametrize("cluster", [dict(replicas=2, router="least_loaded"), dict(prefill_replicas=1, decode_replicas=1)])
def test_no_plan_changes_after_it_is_written_in_a_simulated_cluster(monkeypatch, cluster):
    recorder = PlanRecorder(monkeypatch)
    cfg = small_run(cluster=ClusterConfig(**cluster), executor=ExecutorConfig(name="sim", cost_model="roofline"))
    result = ClusterSim(cfg, build_executor).serve(_requests(cfg))
    assert all(r.is_finished for r in result.requests)
    assert recorder.check() == result.stats.iterations


def _requests(cfg):
    from cbjax.workload import build_workload

    return build_workload(cfg.workload, cfg.seed)


def test_a_plan_and_its_copy_compare_by_value():
    # the check above relies on value equality of plans: a changed field must show
    plan = plans()[3]
    written = copy.deepcopy(plan)
    assert plan == written
    plan.start_s = 1.0
    assert plan != written
    assert dataclasses.replace(written, swap_in=[("x", (1,))]) != written
    json.dumps(dataclasses.asdict(written))  # plain data all through
