"""Shared fixtures: request builders and an executor that checks scheduler invariants each step."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from cbjax.core.executor import StepOutput, SyncExecutor
from cbjax.core.request import Request, SamplingParams, Status
from cbjax.core.timing import NO_CONTEXT, StepTime
from cbjax.sim.timeline import Timeline

REPO = Path(__file__).resolve().parents[1]


def native_unavailable():
    """None where the native CPU kernels package is installed and its kernels build here, else why not."""
    try:
        from cbjax.kernels.native import ensure_registered
    except ModuleNotFoundError:
        return "the native CPU kernels package (cbjax.kernels.native) is not installed"
    return ensure_registered()


def pytest_runtest_setup(item):
    # `native`: the test runs the native CPU kernels, which need their package and a GCC compiler
    if item.get_closest_marker("native") is not None:
        why = native_unavailable()
        if why is not None:
            pytest.skip(f"native CPU kernels unavailable: {why}")
SHARED = REPO.parent / "shared"
AZURE_TRACE = SHARED / "traces" / "AzureLLMInferenceTrace_code.csv"
# what experiments/calibrate.py's base_config reads of a profile, for a tiny model: the fidelity
# scripts' tests give it to the scripts with the engine faked
SCRIPT_PROFILE = {
    "made_for": {"model.vocab_size": 64, "model.d_model": 32, "model.num_layers": 1, "model.num_heads": 2,
                 "model.num_kv_heads": 1, "model.head_dim": 16, "model.ffn_dim": 64, "model.max_model_len": 256,
                 "scheduler.max_num_seqs": 4, "cache.page_size": 16},
    "max_num_batched_tokens": 256, "token_buckets": [16, 256], "num_pages": 64,
}  # fmt: skip


def make_requests(output_lens, prompt_lens=None, arrivals=None, max_tokens=None):
    """Length-only requests with the given target output lengths."""
    n = len(output_lens)
    prompt_lens = prompt_lens or [8] * n
    arrivals = arrivals or [0.0] * n
    return [
        Request(
            request_id=str(i),
            arrival_s=float(arrivals[i]),
            prompt_len=int(prompt_lens[i]),
            sampling=SamplingParams(max_tokens=int(max_tokens or output_lens[i]), ignore_eos=True),
            target_output_len=int(output_lens[i]),
        )
        for i in range(n)
    ]


class FixedCost:
    """A cost model whose every step takes `seconds`."""

    name, history = "fixed", 0

    def __init__(self, seconds: float = 1.0):
        self.time = StepTime(seconds)

    def __call__(self, plan, ctx=NO_CONTEXT) -> StepTime:
        return self.time


class CheckingExecutor(SyncExecutor):
    """Fixed-cost simulated executor that asserts the scheduler's invariants on every plan."""

    def __init__(self, scheduler, duration_s: float = 1.0):
        self.scheduler = scheduler
        self.duration_s = duration_s
        self.plans = 0

    def timeline(self) -> Timeline:
        return Timeline(FixedCost(self.duration_s))

    def execute(self, plan):
        sched = self.scheduler
        reqs = sched.requests_of(plan)
        assert [s.request_id for s in plan.scheduled] == [r.request_id for r in reqs]
        slots = [s.slot for s in plan.scheduled]
        assert slots == [r.slot for r in reqs]
        assert len(set(slots)) == len(slots), f"slot assigned twice: {slots}"
        assert all(0 <= s < sched.max_num_seqs for s in slots)
        assert len(reqs) <= sched.max_num_seqs
        assert len({id(r) for r in reqs}) == len(reqs), "request scheduled twice"
        assert all(s.num_new_tokens >= 1 for s in plan.scheduled), "a request scheduled with nothing to process"
        assert [(s.num_computed, s.num_new_tokens) for s in plan.scheduled] == [(r.num_computed, r.num_new_tokens) for r in reqs]
        assert plan.num_batched_tokens <= sched.token_budget
        assert sched.allocator.num_used_pages <= sched.allocator.num_usable_pages
        sched.allocator.check_invariants()
        for r in reqs:
            assert sched.slots[r.slot] is r
            table = sched.allocator.page_tables[r.request_id]
            assert len(table) * sched.allocator.page_size >= r.num_computed + r.num_new_tokens
        self.check_slot_state(plan)
        self.plans += 1
        return StepOutput(token_ids=None)

    def check_slot_state(self, plan):
        """The executor's own per-slot state, kept from what plans say changed, must equal the
        allocator's tables: a missed page-table update or a stale slot fails here."""
        sched = self.scheduler
        if not hasattr(self, "slot_tables"):
            self.slot_tables = {}
        for s in plan.scheduled:
            if s.sampling is not None:
                assert s.page_table is not None, f"request {s.request_id} took slot {s.slot} without its page table"
                self.slot_tables[s.slot] = None
            if s.page_table is not None:
                self.slot_tables[s.slot] = s.page_table
            assert self.slot_tables.get(s.slot) == tuple(sched.allocator.page_tables[s.request_id]), s.request_id


class ContentCheckingExecutor(CheckingExecutor):
    """Also models the KV cache's contents: a page holds the token id at each position written
    to it. Every scheduled request must find its own tokens at its computed positions, so a
    wrong prefix-cache hit, a shared page overwritten or a lost swap fails here. Swaps copy
    page contents to a host dict and back. With `tokens`, it emits token ids that depend only
    on the sequence so far (equal prompts generate equal tokens, so decode pages are shared
    too); otherwise tokens stay simulated (None)."""

    def __init__(self, scheduler, duration_s: float = 1.0, tokens: bool = True):
        super().__init__(scheduler, duration_s)
        self.tokens = tokens
        self.pages: dict[int, list] = {}
        self.host: dict[str, list[list]] = {}

    def execute(self, plan):
        super().execute(plan)
        ps = plan.page_size
        known = {r.request_id: r for r in sched_requests(self.scheduler)}
        for rid, src in plan.swap_out:
            req = known[rid]
            assert req.status is Status.WAITING and len(src) == -(-req.num_computed // ps)
            assert rid not in self.host
            self.host[rid] = [list(self.pages[p]) for p in src]
        for rid, dst in plan.swap_in:
            req = known[rid]
            copies = self.host.pop(rid)
            assert req.status is Status.RUNNING and len(copies) == len(dst)
            for page, copy in zip(dst, copies):
                self.pages[page] = copy
        out = []
        for req in self.scheduler.requests_of(plan):
            seq = req.prompt_ids() + req.output_token_ids
            table = self.scheduler.allocator.page_tables[req.request_id]
            # generated tokens the simulator never materialized are ("sim", request, position);
            # a decode stretch's steps each write one more (`Schedule.num_steps`)
            end = req.num_computed + req.num_new_tokens + plan.num_steps - 1
            seq += [("sim", req.request_id, pos) for pos in range(len(seq), max(req.num_tokens, end))]
            for pos in range(req.num_computed):
                got = self.pages.get(table[pos // ps], [None] * ps)[pos % ps]
                assert got == seq[pos], f"request {req.request_id}: position {pos} holds {got}, not {seq[pos]}"
            for pos in range(req.num_computed, end):
                self.pages.setdefault(table[pos // ps], [None] * ps)[pos % ps] = seq[pos]
            out.append((sum(seq[:end]) * 31 + end) % 97 if self.tokens else 0)
        return StepOutput(token_ids=out if self.tokens else None)


@pytest.fixture
def no_compiler(monkeypatch, tmp_path):
    """`cbjax.kernels.native` as on a machine without a C++ compiler; the kernels this process
    registered come back afterwards (a process registers them once; later tests use them)."""
    native = pytest.importorskip("cbjax.kernels.native.build", reason="the native CPU kernels package is not installed")

    assert native.ensure_registered() is None
    saved = dict(native._state)
    monkeypatch.setattr(native, "_compiler", lambda: None)
    monkeypatch.setenv("CBJAX_NATIVE_DIR", str(tmp_path))
    native._state.clear()
    yield
    native._state.clear()
    native._state.update(saved)


@pytest.fixture
def env_cpu():
    """Environment for subprocesses: no GPU probing, repo on the path."""
    env = dict(os.environ)
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    return env


def cbjax_cmd():
    return [sys.executable, "-m", "cbjax"]


def assert_every_request_ends_once(sched, requests, result, max_model_len):
    """Every request ends exactly once with a fate, no token is lost or repeated across
    preemptions, and every page is back (free, or in the prefix cache) after the run."""
    from cbjax.core.request import FinishReason

    assert len(sched.finished) == len(requests)
    assert {id(r) for r in sched.finished} == {id(r) for r in requests}
    for r in requests:
        assert r.finish_reason is not None
        if r.finish_reason is FinishReason.REJECTED:
            assert r.reject_reason
        else:
            assert r.num_generated == min(r.target_output_len, max_model_len - r.prompt_len)
            assert r.first_token_s <= r.finish_s
    sched.allocator.check_invariants()
    assert sched.allocator.num_free_pages == sched.allocator.num_usable_pages
    assert result.preemptions == sum(r.num_preemptions for r in requests)


def sched_requests(sched):
    """Every unfinished request the scheduler holds: running and waiting."""
    return list(sched.running) + list(sched.policy)


def make_plan(num_slots, decodes=(), prefills=(), swap_out=(), swap_in=(), **kwargs):
    """A data-only `Schedule` from requests whose `num_computed`/`num_new_tokens` are set by
    hand (cost-model tests); swap entries may name requests. Decodes process one token."""
    from cbjax.core.plan import Schedule, ScheduledRequest

    def entry(req, decode):
        n = 1 if decode else req.num_new_tokens
        return ScheduledRequest(req.request_id, req.slot, req.num_computed, n, decode)

    def swaps(entries):
        return [(r if isinstance(r, str) else r.request_id, tuple(pages)) for r, pages in entries]

    scheduled = [entry(r, True) for r in decodes] + [entry(r, False) for r in prefills]
    return Schedule(num_slots=num_slots, scheduled=scheduled, swap_out=swaps(swap_out), swap_in=swaps(swap_in), **kwargs)


def data_plan(num_slots, decodes=(), prefills=(), page_tables=None, page_size=1, **kwargs):
    """A data-only `Schedule` for packer and step tests, from requests with `num_computed`,
    `num_new_tokens`, `slot` and tokens set by hand: each entry carries its new token ids (or
    feeds from the previous step when a decode's token is not on the host), its whole
    page-table row from `page_tables`, and its sampling knobs."""
    from cbjax.core.plan import Schedule, ScheduledRequest

    def entry(r, decode):
        lo, n = r.num_computed, r.num_new_tokens
        seq = r.prompt_ids() + r.output_token_ids
        feed = n == 1 and lo >= len(seq)
        return ScheduledRequest(
            r.request_id, r.slot, lo, n, decode, token_ids=None if feed else tuple(seq[lo : lo + n]),
            feed_previous=feed, page_table=tuple(page_tables[r.request_id]) if page_tables else None,
            sampling=r.sampling,
        )  # fmt: skip

    scheduled = [entry(r, True) for r in decodes] + [entry(r, False) for r in prefills]
    return Schedule(num_slots=num_slots, scheduled=scheduled, page_size=page_size, **kwargs)
