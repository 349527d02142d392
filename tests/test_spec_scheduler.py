"""Speculative decoding in the scheduler: drafts in the budget and the pages, accepted tokens
taken in step by step, stop tokens inside accepted drafts, and the allocator's invariants over
a long run with rejections and preemptions."""

from __future__ import annotations

import pytest

from conftest import make_requests
from cbjax.config import CacheConfig, SchedulerConfig, SpecConfig
from cbjax.core.executor import SyncExecutor
from cbjax.core.plan import StepOutput
from cbjax.core.request import FinishReason, Request, SamplingParams
from cbjax.engine.offline import serve
from cbjax.scheduler import Scheduler
from cbjax.sim import SimExecutor, UnitCost
from cbjax.sim.acceptance import SeededAcceptance
from cbjax.sim.timeline import Timeline


class Scripted:
    """An acceptance model that reads each (request, decode step)'s count from a script."""

    def __init__(self, script: dict[str, list[int]]):
        self.script = script

    def accepted(self, request_id: str, step: int, num_drafts: int) -> int:
        return min(self.script[request_id][step], num_drafts)


class Recorder:
    """on_step: each plan's rows as (request, num_computed, num_new_tokens, num_drafts) at its end."""

    def __init__(self):
        self.steps = []

    def __call__(self, plan, end, batched, requests):
        rows = tuple((s.request_id, s.num_computed, s.num_new_tokens, s.num_drafts) for s in plan.scheduled)
        self.steps.append((end, rows))


def scheduler(spec=None, max_seqs=8, budget=1024, num_pages=256, page_size=4, prefix=False, eos=None, **cfg):
    return Scheduler(
        SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=budget, **cfg),
        CacheConfig(num_pages=num_pages, page_size=page_size, prefix_caching=prefix), 4096,
        spec=spec, eos_token_id=eos,
    )  # fmt: skip


def test_one_request_accepting_as_scripted_step_by_step_on_the_unit_cost_model():
    # prompt 8, 10 tokens, k = 3, page size 4. t=1: the prefill yields token 1. t=2: 3 drafts,
    # 1 accepted: tokens 2-3. t=3: 3 drafts, all accepted: tokens 4-7. t=4: only 2 drafts fit
    # before token 10 (10 - 7 - 1), none accepted: token 8. t=5: 1 draft, accepted: tokens 9-10.
    spec = SpecConfig(method="ngram", num_tokens=3)
    sched = scheduler(spec)
    [req] = make_requests([10])
    rec = Recorder()
    result = serve([req], sched, SimExecutor(UnitCost(), acceptance=Scripted({"0": [1, 3, 0, 1]})), on_step=rec)
    assert [rows for _, rows in rec.steps] == [
        (("0", 0, 8, 0),),
        (("0", 8, 4, 3),),  # its own token at position 8, drafts at 9-11
        (("0", 10, 4, 3),),  # 8 + 1 + 1 accepted
        (("0", 14, 3, 2),),  # 10 + 1 + 3
        (("0", 15, 2, 1),),  # 14 + 1 + 0
    ]
    assert [end for end, _ in rec.steps] == [1.0, 2.0, 3.0, 4.0, 5.0]
    assert result.stats.iterations == 5 and req.finish_s == 5.0 and req.first_token_s == 1.0
    assert req.num_generated == 10 and req.finish_reason is FinishReason.LENGTH
    assert req.spec_steps == [(3, 1), (3, 3), (2, 0), (1, 1)]
    assert (req.spec_proposed, req.spec_accepted) == (9, 5)
    assert sched.allocator.num_used_pages == 0
    # one gap per step that yielded tokens: 4 gaps of 1 s (TPOT: 4 s over 9 tokens)
    assert result.tbt_s == [1.0, 1.0, 1.0, 1.0]


def test_always_and_never_accepted_drafts_against_no_speculation():
    def run(spec, rate):
        sched = scheduler(spec)
        reqs = make_requests([10, 4], prompt_lens=[8, 5])
        acceptance = SeededAcceptance([rate]) if spec else None
        return serve(reqs, sched, SimExecutor(UnitCost(), acceptance=acceptance)), reqs

    base, base_reqs = run(None, 0.0)
    assert base.stats.iterations == 10 and [r.finish_s for r in base_reqs] == [10.0, 4.0]
    # every draft accepted, k = 3: request 0 yields 1, +4, +4, then 1 (no room for a draft): t=4;
    # request 1 yields 1, then +3 (2 drafts fit before its 4th token): t=2
    full, full_reqs = run(SpecConfig(method="draft", draft_layers=1, num_tokens=3), 1.0)
    assert full.stats.iterations == 4 and [r.finish_s for r in full_reqs] == [4.0, 2.0]
    assert [r.spec_steps for r in full_reqs] == [[(3, 3), (3, 3), (0, 0)], [(2, 2)]]
    # none accepted: as without speculation, every decode verifying what fits
    none, none_reqs = run(SpecConfig(method="draft", draft_layers=1, num_tokens=3), 0.0)
    assert none.stats.iterations == 10 and [r.finish_s for r in none_reqs] == [10.0, 4.0]
    assert none_reqs[1].spec_steps == [(2, 0), (1, 0), (0, 0)]
    assert all(r.num_generated == b.num_generated for r, b in zip(none_reqs + full_reqs, base_reqs * 2))


def test_drafts_take_what_the_token_budget_leaves_after_every_decode_has_its_own_token():
    # budget 6: both prompts of 3 prefill in step 1; then the two decodes take 2 and the drafts
    # share the other 4 in plan order, each also capped by its remaining length (6 - generated - 1)
    spec = SpecConfig(method="ngram", num_tokens=3)
    sched = scheduler(spec, max_seqs=2, budget=6)
    reqs = make_requests([6, 6], prompt_lens=[3, 3])
    rec = Recorder()
    result = serve(reqs, sched, SimExecutor(UnitCost(), acceptance=SeededAcceptance([0.0])), on_step=rec)
    drafts = [[row[3] for row in rows] for _, rows in rec.steps[1:]]
    assert drafts == [[3, 1], [3, 1], [2, 2], [1, 1], [0, 0]]
    assert all(sum(row[2] for row in rows) <= 6 for _, rows in rec.steps)
    assert result.stats.iterations == 6


def test_drafts_shrink_to_the_free_pages_and_never_preempt():
    # 4 usable pages of 4 tokens. Step 1 admits request 0 (prompt 7: 2 pages) and 1 (prompt 4:
    # 1 page). Step 2: request 1's own token takes the last free page; request 0's 2 drafts
    # would need a third page: it verifies none, while request 1's 2 drafts fit its own pages.
    spec = SpecConfig(method="ngram", num_tokens=3)
    sched = scheduler(spec, max_seqs=2, num_pages=5)
    reqs = make_requests([4, 4], prompt_lens=[7, 4])
    rec = Recorder()
    result = serve(reqs, sched, SimExecutor(UnitCost(), acceptance=SeededAcceptance([1.0])), on_step=rec)
    assert rec.steps[1][1] == (("0", 7, 1, 0), ("1", 4, 3, 2))
    assert result.stats.iterations == 3 and sched.num_preemptions == 0


class PoolWatch(SimExecutor):
    """A simulated executor that checks the allocator after every plan and records the pages
    the scheduler reports as used while a plan with drafts runs."""

    def __init__(self, sched, acceptance):
        super().__init__(UnitCost(), acceptance=acceptance)
        self.sched = sched
        self.used = []  # (pages used, pages of the rows' computed tokens + their own token) per plan

    def execute(self, plan):
        alloc = self.sched.allocator
        alloc.check_invariants()
        reqs = self.sched.requests_of(plan)
        for row, req in zip(plan.scheduled, reqs):
            assert (row.num_computed, row.num_new_tokens) == (req.num_computed, req.num_new_tokens)
            assert len(alloc.page_tables[row.request_id]) * alloc.page_size >= row.num_computed + row.num_new_tokens
            assert row.num_drafts == 0 or row.is_decode
            assert row.num_computed + row.num_new_tokens <= req.prompt_len + req.max_output_len - 1
        assert plan.num_batched_tokens <= self.sched.token_budget
        self.used.append((self.sched.load().pages_used, sum(row.num_drafts for row in plan.scheduled)))
        return super().execute(plan)


@pytest.mark.parametrize("preemption", ["recompute", "swap"])
def test_pool_invariants_hold_after_every_step_of_2000_requests_with_rejections_and_preemptions(preemption):
    spec = SpecConfig(method="ngram", num_tokens=4, acceptance_rate=0.6)
    sched = scheduler(spec, max_seqs=24, budget=96, num_pages=48, page_size=4, prefix=True,
                      preemption=preemption, chunked_prefill=True)  # fmt: skip
    import random

    rng = random.Random(7)
    reqs = make_requests(
        [rng.randint(2, 30) for _ in range(2000)], prompt_lens=[rng.randint(3, 40) for _ in range(2000)],
        arrivals=[i * 0.25 for i in range(2000)],
    )  # fmt: skip
    for r in reqs[::3]:  # shared prompts: prefix-cache hits on accepted pages
        r.synthetic_prompt = (1, 100)
    watch = PoolWatch(sched, SeededAcceptance([0.6], seed=3))
    result = serve(reqs, sched, watch)
    sched.allocator.check_invariants()
    assert sched.allocator.num_used_pages == 0 and not sched.running
    assert all(r.num_generated == r.target_output_len for r in reqs)
    assert sched.num_preemptions > 50
    steps = [s for r in reqs for s in r.spec_steps]
    assert sum(1 for p, a in steps if a < p) > 1000  # rejections
    assert sum(1 for p, a in steps if p and a == p) > 1000  # all accepted
    assert result.stats.iterations == len(watch.used)
    assert sum(p for p, _ in steps) == sum(d for _, d in watch.used)


def test_a_running_requests_draft_pages_show_in_kv_cache_pages_used():
    def used_while_decoding(spec):
        sched = scheduler(spec, page_size=4)
        [req] = make_requests([8], prompt_lens=[7])
        watch = PoolWatch(sched, SeededAcceptance([0.0]) if spec else None)
        serve([req], sched, watch, stretches=False)  # a plan per step: the pool as each step runs
        return [u for u, _ in watch.used]

    # prompt 7 in 2 pages of 4; its first decode processes position 7, still in page 2; with 5
    # drafts it also writes positions 8..12: pages 3 and 4 are used while it runs
    assert used_while_decoding(None)[:2] == [2, 2]
    assert used_while_decoding(SpecConfig(method="ngram", num_tokens=5))[:2] == [2, 4]


class MarkovEngine(SyncExecutor):
    """A token-reading executor whose model is `rule(last token)`: it verifies drafts greedily,
    as the engine does (accept the longest prefix equal to the model's own tokens, then add the
    model's token after it), on the unit cost model."""

    reads_token_ids = True

    def __init__(self, rule):
        self.rule = rule

    def timeline(self) -> Timeline:
        return Timeline(UnitCost())

    def execute(self, plan):
        tokens, accepted, accepted_ids = [], [], []
        for row in plan.scheduled:
            own = row.token_ids[: row.num_new_tokens - row.num_drafts]
            drafts = row.token_ids[len(own) :]
            y, a = self.rule(own[-1]), 0
            while a < len(drafts) and drafts[a] == y:
                y, a = self.rule(drafts[a]), a + 1
            tokens.append(y)
            accepted.append(a)
            accepted_ids.append(tuple(drafts[:a]))
        if not any(row.num_drafts for row in plan.scheduled):
            return StepOutput(tokens)
        return StepOutput(tokens, num_accepted=accepted, accepted_ids=accepted_ids)


def cycle_rule(t: int) -> int:
    """0 1 2 3 4 5 6 then 2 3 4 5 6 2 ...: the prompt 0..9 says 7 follows 6, the model says 2."""
    return 2 if t == 6 else (t + 1) % 10


def markov_requests(n=4, output_len=24, stop=()):
    return [
        Request(str(i), float(i), 10, list(range(10)), SamplingParams(max_tokens=output_len, stop_token_ids=stop))
        for i in range(n)
    ]


def test_ngram_drafts_on_a_token_reading_executor_give_the_same_tokens_in_fewer_steps():
    def run(spec):
        reqs = markov_requests()
        sched = scheduler(spec, prefix=True)
        result = serve(reqs, sched, MarkovEngine(cycle_rule))
        return result, reqs

    base, base_reqs = run(None)
    spec_result, spec_reqs = run(SpecConfig(method="ngram", num_tokens=3, ngram_min=1, ngram_max=3))
    expected = [0, 1, 2, 3, 4, 5, 6] + [2, 3, 4, 5, 6] * 4
    assert all(r.output_token_ids == expected[:24] for r in base_reqs + spec_reqs)
    assert spec_result.stats.iterations < base.stats.iterations
    # decode 1 sees ...9 0: the lookup of [0] proposes 1 2 3 from the prompt, all accepted, and
    # the model adds 4. Decode 2 sees ...2 3 4: the prompt proposes 5 6 7, the model says 2
    # after 6: 2 accepted. From then on the output's own cycle proposes right: 1 + 4 + 3 + 4 x 4.
    assert spec_reqs[0].spec_steps == [(3, 3), (3, 2), (3, 3), (3, 3), (3, 3), (3, 3)]
    assert spec_result.stats.iterations == 4 + 6 and base.stats.iterations == 4 + 23


def test_a_stop_token_inside_accepted_drafts_ends_the_request_there():
    # the first decode verifies drafts 1 2 3 for its token 0 and the model accepts all three;
    # 2 is a stop token: the request ends with 0 1 2, the rest dropped
    [req] = markov_requests(n=1, stop=(2,))
    sched = scheduler(SpecConfig(method="ngram", num_tokens=3), eos=None)
    result = serve([req], sched, MarkovEngine(cycle_rule))
    assert req.output_token_ids == [0, 1, 2] and req.num_generated == 3
    assert req.finish_reason is FinishReason.STOP and result.stats.iterations == 2
    assert req.spec_steps == [(3, 3)]
    assert sched.allocator.num_used_pages == 0


def test_eos_inside_accepted_drafts_ends_the_request_unless_ignored():
    def run(ignore_eos):
        [req] = markov_requests(n=1)
        req.sampling.ignore_eos = ignore_eos
        serve([req], scheduler(SpecConfig(method="ngram", num_tokens=3), eos=3), MarkovEngine(cycle_rule))
        return req

    stopped = run(False)
    assert stopped.output_token_ids == [0, 1, 2, 3] and stopped.finish_reason is FinishReason.EOS
    assert run(True).num_generated == 24


class KVMarkovEngine(MarkovEngine):
    """`MarkovEngine` that also models the KV cache's contents, a token id per position written,
    rejected drafts included: every row must find its own tokens at its computed positions, so a
    page of rejected drafts registered in the prefix cache and matched later fails here."""

    def __init__(self, rule, sched):
        super().__init__(rule)
        self.sched = sched
        self.pages: dict[int, dict[int, int]] = {}

    def execute(self, plan):
        alloc = self.sched.allocator
        ps = alloc.page_size
        for row, req in zip(plan.scheduled, self.sched.requests_of(plan)):
            seq = req.prompt_ids() + req.output_token_ids
            table = alloc.page_tables[row.request_id]
            for pos in range(row.num_computed):
                got = self.pages.get(table[pos // ps], {}).get(pos % ps)
                assert got == seq[pos], f"request {row.request_id}: position {pos} holds {got}, not {seq[pos]}"
            for j, tok in enumerate(row.token_ids):
                pos = row.num_computed + j
                self.pages.setdefault(table[pos // ps], {})[pos % ps] = tok
        return super().execute(plan)


def test_the_prefix_cache_registers_only_pages_of_accepted_tokens():
    # a pool too small for six requests: recomputed requests come back and find their own
    # registered pages (prompt and output); a page holding rejected drafts must never be one
    reqs = markov_requests(n=6, output_len=40)
    sched = scheduler(SpecConfig(method="ngram", num_tokens=3), max_seqs=6, num_pages=25, page_size=4, prefix=True)
    serve(reqs, sched, KVMarkovEngine(cycle_rule, sched))
    expected = ([0, 1, 2, 3, 4, 5, 6] + [2, 3, 4, 5, 6] * 8)[:40]
    assert all(r.output_token_ids == expected for r in reqs)
    assert sched.num_preemptions > 0 and sched.prefix.tokens_hit > sched.prefix.prompt_tokens_hit
    assert any(a < p for r in reqs for p, a in r.spec_steps)
    assert sched.allocator.num_used_pages == 0
