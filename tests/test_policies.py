"""Policies behind the one interface: invariants under binding limits, and hand-computed cases."""

import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import CheckingExecutor, assert_every_request_ends_once, make_requests
from cbjax.cache import ALLOCATIONS
from cbjax.app.choices import policy_names
from cbjax.config import CacheConfig, SchedulerConfig
from cbjax.engine.offline import serve
from cbjax.core.request import Status
from cbjax.scheduler import POLICIES, Scheduler

LOOSE = dict(max_num_batched_tokens=1_000_000)
BIG_CACHE = CacheConfig(num_pages=1024, page_size=16)

# Every policy, with its preemption switched on where it has one.
VARIANTS = {
    "priority": dict(name="priority"),
    "priority_preempt": dict(name="priority", priority_preempt=True),
    "sjf_oracle": dict(name="sjf", predictor="oracle"),
    "sjf_mean": dict(name="sjf", predictor="mean"),
    "mlfq": dict(name="mlfq", mlfq_num_queues=3, mlfq_base_quantum=2, mlfq_preempt=False),
    "mlfq_preempt": dict(name="mlfq", mlfq_num_queues=3, mlfq_base_quantum=2, mlfq_preempt=True),
    "vtc": dict(name="vtc"),
}


class PolicyCheckingExecutor(CheckingExecutor):
    """Also checks that the policy's queue holds exactly the waiting requests."""

    def execute(self, plan):
        sched = self.scheduler
        waiting = list(sched.policy)
        assert len(waiting) == len(sched.policy) == len({id(r) for r in waiting})
        assert all(r.status is Status.WAITING and r.slot == -1 for r in waiting)
        assert not {id(r) for r in waiting} & {id(r) for r in sched.running}
        return super().execute(plan)


def run(cfg_kw, requests, num_slots, cache=BIG_CACHE, max_model_len=100_000, executor=None, stretches=True, **sched_kw):
    cfg = SchedulerConfig(max_num_seqs=num_slots, **{**LOOSE, **sched_kw, **cfg_kw})
    sched = Scheduler(cfg, cache, max_model_len)
    ex = (executor or PolicyCheckingExecutor)(sched)
    return serve(requests, sched, ex, stretches=stretches), sched, ex


def finish_times(requests):
    return {r.request_id: r.finish_s for r in requests}


def test_every_policy_is_registered_and_configurable():
    assert set(POLICIES) == set(policy_names()) == {"static", "fcfs", "priority", "sjf", "mlfq", "vtc"}
    with pytest.raises(ValueError, match="scheduler.predictor_path"):
        SchedulerConfig(name="sjf", predictor="learned")
    with pytest.raises(ValueError, match="scheduler.predictor: unknown value 'magic'"):
        SchedulerConfig(predictor="magic")
    with pytest.raises(ValueError, match="scheduler.mlfq_base_quantum"):
        SchedulerConfig(mlfq_base_quantum=0)


@pytest.mark.parametrize("policy", ["priority", "sjf", "mlfq", "vtc"])
def test_yaml_inherits_fcfs(policy):
    from hydra import compose, initialize_config_dir

    from cbjax.app.cli import CONFIG_DIR, to_run_config

    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        cfg = to_run_config(compose(config_name="config", overrides=[f"scheduler={policy}"]))
    assert cfg.scheduler.name == policy
    assert cfg.scheduler.max_num_seqs == SchedulerConfig().max_num_seqs  # from fcfs.yaml


def test_scheduler_and_policies_never_import_jax(env_cpu):
    code = (
        "import sys\n"
        "from cbjax.config import SchedulerConfig\n"
        "from cbjax.scheduler import POLICIES, make_policy\n"
        "for name in POLICIES: make_policy(SchedulerConfig(name=name))\n"
        "assert 'jax' not in sys.modules, 'a policy imported jax'\n"
    )
    subprocess.run([sys.executable, "-c", code], env=env_cpu, check=True, timeout=60)


# ---- invariants under binding limits, every policy ----

workloads = st.lists(
    # arrival, prompt, output, priority, client
    st.tuples(st.floats(0, 30), st.integers(1, 60), st.integers(1, 30), st.integers(0, 3), st.sampled_from("abc")),
    min_size=1,
    max_size=30,
)
# Slots, token budget and KV pages small enough to bind: preemptions and chunked recomputes.
binding_limits = dict(
    allocation=st.sampled_from(ALLOCATIONS),
    num_slots=st.integers(1, 6),
    budget=st.integers(6, 120),
    num_pages=st.integers(6, 40),
    page_size=st.sampled_from([1, 4, 16]),
)


@pytest.mark.parametrize("variant", list(VARIANTS))
@settings(max_examples=30, deadline=None)
@given(reqs=workloads, **binding_limits)
def test_invariants_under_binding_limits(variant, reqs, allocation, num_slots, budget, num_pages, page_size):
    requests = make_requests([r[2] for r in reqs], [r[1] for r in reqs], [r[0] for r in reqs])
    for req, (*_, priority, client) in zip(requests, reqs):
        req.priority, req.client_id = priority, client
    cache = CacheConfig(num_pages=num_pages, page_size=page_size, allocation=allocation, prefix_caching=False)
    result, sched, _ = run(
        VARIANTS[variant], requests, num_slots, cache, max_model_len=64, max_num_batched_tokens=max(budget, num_slots)
    )
    assert len(sched.policy) == 0 and not sched.running
    assert_every_request_ends_once(sched, requests, result, max_model_len=64)


@pytest.mark.parametrize(
    "cfg_kw",
    [
        dict(name="priority", priority_preempt=True),  # all priorities equal
        dict(name="mlfq", mlfq_num_queues=1, mlfq_preempt=True),  # one queue
        dict(name="vtc"),  # one client
    ],
    ids=["priority", "mlfq", "vtc"],
)
@settings(max_examples=25, deadline=None)
@given(reqs=workloads, **binding_limits)
def test_degenerate_configs_reproduce_fcfs_exactly(cfg_kw, reqs, allocation, num_slots, budget, num_pages, page_size):
    # With one rank for everybody, latest-preempted-first requeues and latest-admitted victims
    # make these policies fcfs, binding limits, preemptions and chunked recomputes included.
    cache = CacheConfig(num_pages=num_pages, page_size=page_size, allocation=allocation, prefix_caching=False)

    def outcome(kw):
        requests = make_requests([r[2] for r in reqs], [r[1] for r in reqs], [r[0] for r in reqs])
        run(kw, requests, num_slots, cache, max_model_len=64, max_num_batched_tokens=max(budget, num_slots))
        return [(r.scheduled_s, r.finish_s, r.num_preemptions, r.finish_reason) for r in requests]

    assert outcome(cfg_kw) == outcome(dict(name="fcfs"))


# ---- sjf ----


def test_sjf_oracle_beats_fcfs_on_mean_latency_by_hand():
    # Unit cost, 2 slots, all at t=0, output lengths r0..r4 = 8, 7, 1, 2, 3. A request admitted
    # at t with output L finishes at t + L.
    #   fcfs: r0 0->8, r1 0->7, r2 7->8, r3 8->10, r4 8->11: mean (8+7+8+10+11)/5 = 44/5 = 8.8
    #   sjf:  r2 0->1, r3 0->2, r4 1->4, r1 2->9, r0 4->12:  mean (1+2+4+9+12)/5 = 28/5 = 5.6
    lengths = [8, 7, 1, 2, 3]
    fcfs = make_requests(lengths)
    sjf = make_requests(lengths)
    run(dict(name="fcfs"), fcfs, 2)
    run(dict(name="sjf", predictor="oracle"), sjf, 2)
    assert finish_times(fcfs) == {"0": 8, "1": 7, "2": 8, "3": 10, "4": 11}
    assert finish_times(sjf) == {"0": 12, "1": 9, "2": 1, "3": 2, "4": 4}
    mean = lambda reqs: sum(r.finish_s - r.arrival_s for r in reqs) / len(reqs)  # noqa: E731
    assert (mean(fcfs), mean(sjf)) == (8.8, 5.6)


def test_sjf_mean_predictor_keeps_fcfs_order():
    a, b = make_requests([9, 2, 5], arrivals=[0, 0, 0]), make_requests([9, 2, 5], arrivals=[0, 0, 0])
    run(dict(name="sjf", predictor="mean"), a, 1)
    run(dict(name="fcfs"), b, 1)
    assert finish_times(a) == finish_times(b) == {"0": 9, "1": 11, "2": 16}


# ---- priority ----


@pytest.mark.parametrize("preempt", [True, False])
def test_priority_preemption_by_hand(preempt):
    # One slot, unit cost. A (priority 5, 10 tokens) starts at 0; B (priority 0, 3 tokens)
    # arrives at 2.5 and joins at t=3, when A has generated 3 tokens.
    #   preempt: A is evicted at 3; B runs 3->6; A recomputes its prompt plus 3 tokens at 6,
    #            which yields its 4th token, and ends its 10th at 6 + 7 = 13.
    #   no preempt: A runs 0->10, then B 10->13.
    a, b = make_requests([10, 3], arrivals=[0.0, 2.5])
    a.priority, b.priority = 5, 0
    result, _, _ = run(dict(name="priority", priority_preempt=preempt), [a, b], 1)
    if preempt:
        assert (b.scheduled_s, b.finish_s, a.finish_s, a.num_preemptions) == (3, 6, 13, 1)
    else:
        assert (b.scheduled_s, b.finish_s, a.finish_s, a.num_preemptions) == (10, 13, 10, 0)
    assert (a.num_generated, b.num_generated) == (10, 3)


def test_priority_victim_when_pages_run_out_is_lowest_priority_latest_admitted():
    # 3 slots, 4 usable pages of 4 tokens, prompts of 3, 5 tokens each (7 stored at most).
    # Priorities r0=2, r1=2, r2=1: admitted r2, r0, r1, one page each. At t=2 every request
    # needs its second page and one is free: r2 takes it; r0 finds none, and the victim is the
    # lowest priority, latest admitted: r1 (fcfs would evict r2, its latest admitted).
    # r0 and r2 end at 5; r1 restarts at 5 with 3 + 2 tokens and ends its 5th token at 8.
    reqs = make_requests([5, 5, 5], prompt_lens=[3, 3, 3])
    for req, priority in zip(reqs, [2, 2, 1]):
        req.priority = priority
    run(dict(name="priority"), reqs, 3, CacheConfig(num_pages=5, page_size=4))
    assert [r.num_preemptions for r in reqs] == [0, 1, 0]
    assert finish_times(reqs) == {"0": 5, "1": 8, "2": 5}


def test_priority_orders_the_queue_fcfs_among_equals():
    reqs = make_requests([1, 1, 1, 1])
    for req, priority in zip(reqs, [3, 1, 3, 1]):
        req.priority = priority
    run(dict(name="priority"), reqs, 1)
    assert [r.request_id for r in sorted(reqs, key=lambda r: r.finish_s)] == ["1", "3", "0", "2"]


class PlanRecorder(PolicyCheckingExecutor):
    """Records each plan's requests by its start: {start: [request ids]}."""

    def __init__(self, scheduler):
        super().__init__(scheduler)
        self.plans_at = {}

    def execute(self, plan):
        self.plans_at[plan.start_s] = [r.request_id for r in self.scheduler.requests_of(plan)]
        return super().execute(plan)


def test_priority_preempt_evicts_nobody_whose_pages_others_still_hold():
    # Prefix caching, pages of 2 tokens, 6 usable pages, 4 slots, unit cost. m (priority 1) and
    # lo (priority 5) share a 5-token prompt; hi (priority 1) has 6 tokens of its own: 3 pages.
    #   t=0: m prefills [1,2][3,4][5]: 3 pages.
    #   t=1: m decodes; lo shares m's two full pages and computes its 5th token in a third
    #        page of its own: 4 pages used.
    #   t=2: m takes a 4th page: 5 used, 1 free. hi arrives needing 3 and outranks lo alone;
    #        lo holds 3 pages, but m holds 2 of them too, so evicting lo frees 1: hi would
    #        still not fit, and lo is not evicted. lo decodes at 2 and 3 (a 4th page at 3:
    #        6 used, and evicting lo would free 2 of the 3 hi needs).
    #   t=4: m ended its 4th token at 4, freeing its 2 own pages; lo's 4 are now its alone:
    #        hi evicts lo (2 + 4 >= 3) and runs 4->5. lo recomputes at 5 and ends its 4th
    #        token at 6.
    m, lo, hi = make_requests([4, 4, 1], prompt_lens=[5, 5, 6], arrivals=[0.0, 1.0, 2.0])
    m.prompt_token_ids = [1, 2, 3, 4, 5]
    lo.prompt_token_ids = [1, 2, 3, 4, 5]
    hi.prompt_token_ids = [9, 9, 8, 8, 7, 7]
    m.priority, lo.priority, hi.priority = 1, 5, 1
    cache = CacheConfig(num_pages=7, page_size=2, prefix_caching=True)
    _, sched, rec = run(dict(name="priority", priority_preempt=True), [m, lo, hi], 4, cache, executor=PlanRecorder)
    assert rec.plans_at[2] == rec.plans_at[3] == ["0", "1"]
    assert rec.plans_at[4] == ["2"]
    assert (m.finish_s, hi.scheduled_s, hi.finish_s, lo.finish_s) == (4, 4, 5, 6)
    assert (lo.num_preemptions, sched.num_preemptions) == (1, 1)


# ---- mlfq ----


def test_mlfq_skip_join_entry_queue():
    from cbjax.scheduler.policies import MLFQPolicy

    policy = MLFQPolicy(SchedulerConfig(name="mlfq", mlfq_num_queues=3, mlfq_base_quantum=2))
    assert policy.quanta == [2, 4, 8]
    # the first queue whose quantum covers the prompt; longer prompts join the last queue
    assert [policy.entry_queue(n) for n in (1, 2, 3, 4, 5, 8, 9, 100)] == [0, 0, 1, 1, 2, 2, 2, 2]
    reqs = make_requests([1, 1, 1], prompt_lens=[9, 3, 2])
    for req in reqs:
        policy.push(req)
    assert [policy.pop().request_id for _ in reqs] == ["2", "1", "0"]  # highest queue first


class LevelRecorder(PolicyCheckingExecutor):
    def __init__(self, scheduler):
        super().__init__(scheduler)
        self.levels = {}  # request_id -> {plan start: queue}

    def execute(self, plan):
        for req in self.scheduler.requests_of(plan):
            self.levels.setdefault(req.request_id, {})[plan.start_s] = self.scheduler.policy.level(req)
        return super().execute(plan)


@pytest.mark.parametrize("preempt", [True, False])
def test_mlfq_demotion_by_hand(preempt):
    # Quanta 2, 4, 8 tokens; one slot; unit cost; prompts of 2 tokens join queue 0.
    # A (10 tokens) starts at 0; B (3 tokens) arrives at 0.5. A's 2nd token (iteration 1)
    # uses queue 0's quantum: A drops to queue 1. At t=2 B (queue 0) outranks A:
    #   preempt: A is evicted; B runs 2->5 (dropping to queue 1 after its 2nd token, at 4).
    #            A recomputes at 5 and yields tokens 3..6 in queue 1 (iterations 5..8): that
    #            is its quantum of 4, so it drops to queue 2 for tokens 7..10 (9..12), ends 13.
    #   no preempt: A runs 0->10 (queue 0 for iterations 0-1, 1 for 2-5, 2 for 6-9), B 10->13.
    a, b = make_requests([10, 3], prompt_lens=[2, 2], arrivals=[0.0, 0.5])
    cfg_kw = dict(name="mlfq", mlfq_num_queues=3, mlfq_base_quantum=2, mlfq_preempt=preempt)
    _, sched, rec = run(cfg_kw, [a, b], 1, executor=LevelRecorder, stretches=False)  # a plan per step, observed
    if preempt:
        assert rec.levels["0"] == {0: 0, 1: 0, 5: 1, 6: 1, 7: 1, 8: 1, 9: 2, 10: 2, 11: 2, 12: 2}
        assert rec.levels["1"] == {2: 0, 3: 0, 4: 1}
        assert (a.finish_s, b.finish_s, a.num_preemptions) == (13, 5, 1)
    else:
        assert rec.levels["0"] == {0: 0, 1: 0, 2: 1, 3: 1, 4: 1, 5: 1, 6: 2, 7: 2, 8: 2, 9: 2}
        assert (a.finish_s, b.finish_s, a.num_preemptions) == (10, 13, 0)
    assert (a.num_generated, b.num_generated) == (10, 3)


# ---- vtc ----


def test_vtc_counter_lift():
    from cbjax.scheduler.policies import VTCPolicy

    policy = VTCPolicy(SchedulerConfig(name="vtc"))  # 1 per input token, 2 per output token
    a1, a2, b1, c1 = make_requests([5, 5, 5, 5])
    for req, client in zip((a1, a2, b1, c1), "aabc"):
        req.client_id = client
    policy.push(a1)
    policy.push(a2)
    assert policy.pop() is a1 and policy.counters["a"] == 8  # its 8 prompt tokens
    a1.num_generated = 5
    policy.on_step([a1], 1.0)
    assert policy.counters["a"] == 18  # + 2 * 5 output tokens
    policy.push(b1)  # b becomes backlogged: lifted to the smallest backlogged counter, a's
    assert policy.counters["b"] == 18
    assert policy.pop() is a2  # a tie: the earlier queued head wins
    assert policy.pop() is b1 and policy.counters == {"a": 26, "b": 26}
    policy.push(c1)  # nobody backlogged: lifted to the counter of b, the last to leave
    assert policy.counters["c"] == 26 and len(policy) == 1


def test_vtc_a_client_whose_last_request_is_withdrawn_is_the_last_to_leave():
    """An abort that empties a client's queue is its leaving: a client arriving to an empty
    queue is lifted to that client's counter, not to an earlier leaver's lower one."""
    from cbjax.scheduler.policies import VTCPolicy

    policy = VTCPolicy(SchedulerConfig(name="vtc"))  # 1 per input token
    a1, b1, b2, c1 = make_requests([5, 5, 5, 5])
    for req, client in zip((a1, b1, b2, c1), "abbc"):
        req.client_id = client
    policy.push(a1)
    assert policy.pop() is a1 and policy.counters["a"] == 8  # a leaves the queue
    policy.push(b1)  # lifted to a's 8
    policy.push(b2)
    assert policy.pop() is b1 and policy.counters["b"] == 16
    policy.remove(b2)  # b2 aborted while waiting: b leaves the queue
    assert len(policy) == 0
    policy.push(c1)  # nobody backlogged: b left last
    assert policy.counters["c"] == 16


class ServiceRecorder(PolicyCheckingExecutor):
    """Per iteration: each client's service W (w_p per prompt token, w_q per output token)
    and whether it was backlogged (had a request waiting) during the iteration."""

    def __init__(self, scheduler, clients=("a", "b"), w_p=1.0, w_q=2.0):
        super().__init__(scheduler)
        self.clients, self.w_p, self.w_q = clients, w_p, w_q
        self.service, self.backlogged = [], []

    def execute(self, plan):
        served = dict.fromkeys(self.clients, 0.0)
        reqs = self.scheduler.requests_of(plan)
        for req, entry in zip(reqs, plan.scheduled):
            if not entry.is_decode:
                served[req.client_id] += self.w_p * req.num_new_tokens
        for req in reqs:  # no chunked prefills here: each yields one token
            served[req.client_id] += self.w_q
        waiting = {r.client_id for r in self.scheduler.policy}
        self.service.append(served)
        self.backlogged.append(all(c in waiting for c in self.clients))
        return super().execute(plan)

    def max_service_difference(self):
        """max |W_a(t1,t2) - W_b(t1,t2)| over intervals in the longest run of iterations where
        both clients are backlogged: the spread of the running difference D(t)."""
        best, start = (0, 0), None
        for i, both in enumerate(self.backlogged + [False]):
            if both and start is None:
                start = i
            elif not both and start is not None:
                best = max(best, (i - start, start))
                start = None
        length, start = best
        diff, lo, hi = 0.0, 0.0, 0.0
        for served in self.service[start : start + length]:
            diff += served["a"] - served["b"]
            lo, hi = min(lo, diff), max(hi, diff)
        return hi - lo, length


def test_vtc_keeps_two_backlogged_clients_within_the_papers_bound_and_fcfs_does_not():
    # Sheng et al., "Fairness in Serving Large Language Models" (OSDI'24, arXiv:2401.00588),
    # the service-difference theorem of the VTC analysis (the "2x tight upper bound"): for
    # any two clients f, g continuously backlogged during [t1, t2),
    #     |W_f(t1, t2) - W_g(t1, t2)| <= 2U,   U = max(w_p * L_input, w_q * M),
    # L_input the longest prompt and M the most tokens a running batch can hold (the KV
    # cache's capacity). Here w_p = 1, w_q = 2, L_input = 8, and M = 24 usable pages x 4
    # tokens = 96, so 2U = 2 * max(8, 192) = 384, independent of the interval's length.
    # Client a sends 2 requests/s, client b 0.5/s (prompt 8, output 10); 4 slots serve 0.4/s,
    # so both stay backlogged. fcfs serves them 4:1 and the gap grows ~6.7 per iteration.
    bound = 2 * max(1 * 8, 2 * 24 * 4)
    gaps = {}
    for policy in ("vtc", "fcfs"):
        a = make_requests([10] * 600, prompt_lens=[8] * 600, arrivals=[0.5 * i for i in range(600)])
        b = make_requests([10] * 150, prompt_lens=[8] * 150, arrivals=[2.0 * i for i in range(150)])
        for req in a:
            req.client_id, req.request_id = "a", "a" + req.request_id
        for req in b:
            req.client_id, req.request_id = "b", "b" + req.request_id
        cfg = SchedulerConfig(name=policy, max_num_seqs=4, **LOOSE)
        # reserve_max: no preemption, so W counts each token once
        sched = Scheduler(cfg, CacheConfig(num_pages=25, page_size=4, allocation="reserve_max", prefix_caching=False), 1000)
        rec = ServiceRecorder(sched)
        serve(a + b, sched, rec, max_iterations=500)
        gaps[policy], window = rec.max_service_difference()
        assert window >= 450, f"{policy}: both clients backlogged for only {window} iterations"
    assert gaps["vtc"] <= bound
    assert gaps["fcfs"] > bound
    assert gaps["vtc"] <= 2 * max(8, 2 * 4 * 10)  # in fact within one batch's worth of service


@pytest.mark.parametrize("name", ["mlfq", "sjf", "vtc"])
def test_an_aborted_request_leaves_nothing_behind_in_its_policy(name):
    """A request that ends outside a step (a client gone, a stop string), running or waiting,
    is forgotten by the policy: a server's policy state does not grow with every abort."""
    sched = Scheduler(SchedulerConfig(name=name, max_num_seqs=1), CacheConfig(num_pages=64, page_size=4), 256)
    reqs = make_requests([20, 20, 20])
    for req in reqs:
        sched.add(req, 0.0)
    plan = sched.schedule(0.0)
    sched.postprocess(plan, None, 1.0)  # request 0 runs, 1 and 2 wait
    assert sched.abort(reqs[0].request_id, 1.0) and sched.abort(reqs[1].request_id, 1.0)
    policy = sched.policy
    held = {"mlfq": lambda: policy._state, "sjf": lambda: policy._predicted,
            "vtc": lambda: {**policy._charged, **policy._arrival_seq}}[name]()  # fmt: skip
    assert reqs[0] not in held and reqs[1] not in held
