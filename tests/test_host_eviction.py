"""The host tier's `session` eviction picks, at every call, the page a plain walk over all
pages in least recently used order picks (the oracle below): under random inserts, uses,
removals, pins and sessions whose next turn becomes expected or not, and inside a run."""

from __future__ import annotations

import random
from collections import OrderedDict

import numpy as np
import pytest

from cbjax.cache.eviction import SessionEviction
from cbjax.config import CacheConfig, SchedulerConfig
from cbjax.core.request import Request, SamplingParams
from cbjax.engine.offline import serve
from cbjax.scheduler import Scheduler
from cbjax.sim import SimExecutor
from cbjax.sim.cost import UnitCost


def reference_victim(order, session_of, expected, droppable):
    """The least recently used droppable page of no session or of a session not expected, else
    the least recently used droppable page; `order` is oldest first."""
    fallback = None
    for page in order:
        if not droppable(page):
            continue
        session = session_of(page)
        if session is None or not expected(session):
            return page
        if fallback is None:
            fallback = page
    return fallback


class FakeView:
    def __init__(self):
        self.sessions: dict[int, str | None] = {}
        self.expected_sessions: set[str] = set()
        self.pinned: set[int] = set()

    def session_of(self, page):
        return self.sessions.get(page)

    def expected(self, session_id):
        return session_id in self.expected_sessions

    def droppable(self, page):
        return page not in self.pinned


@pytest.mark.parametrize("seed", range(6))
def test_random_sequences_give_the_oracles_victim_at_every_call(seed):
    rng = random.Random(seed)
    num_pages, sessions = rng.choice([(8, 2), (40, 5), (200, 12)])
    names = [None] + [f"s{i}" for i in range(sessions)]
    view = FakeView()
    policy = SessionEviction(view)
    order: OrderedDict[int, None] = OrderedDict()  # the pages in use, oldest first
    kinds = dict.fromkeys(("none", "fallback", "other", "other_past_pinned"), 0)
    for _ in range(4000):
        free = [p for p in range(num_pages) if p not in order]
        op = rng.random()
        if op < 0.3 and free:  # a page enters, of a session or none
            page = rng.choice(free)
            view.sessions[page] = rng.choice(names)
            if view.sessions[page] is None:
                del view.sessions[page]
            order[page] = None
            policy.inserted(page)
        elif op < 0.45 and order:  # a page is used again
            page = rng.choice(list(order))
            order.move_to_end(page)
            policy.touched(page)
        elif op < 0.55 and order:  # a load of the plan pins pages: touched, then not droppable
            for page in rng.sample(list(order), rng.randint(1, max(1, len(order) // 3))):
                order.move_to_end(page)
                policy.touched(page)
                view.pinned.add(page)
        elif op < 0.62:  # the plan is written: every page may be dropped again
            view.pinned.clear()
        elif op < 0.8:  # a session's next turn becomes expected, or stops being
            session = rng.choice(names[1:])
            view.expected_sessions ^= {session}
            policy.expected_changed(session)
        elif order:  # a page leaves: the victim, or another page not pinned
            unpinned = [p for p in order if p not in view.pinned]
            victim = policy.victim()
            page = victim if victim is not None and rng.random() < 0.7 else rng.choice(unpinned or [None])
            if page is not None:
                del order[page]
                view.sessions.pop(page, None)
                policy.removed(page)
        expect = reference_victim(order, view.session_of, view.expected, view.droppable)
        assert policy.victim() == expect
        assert list(policy.pages) == list(order)
        others = [p for p in order if not held(view, p)]
        if expect is None:
            kinds["none"] += 1
        elif held(view, expect):
            kinds["fallback"] += 1
        elif others[0] != expect:
            kinds["other_past_pinned"] += 1
        else:
            kinds["other"] += 1
    assert min(kinds.values()) > 0, kinds


def held(view, page):
    session = view.session_of(page)
    return session is not None and view.expected(session)


class CheckedSession(SessionEviction):
    """The `session` policy checking each victim against the oracle over the tier's view."""

    calls = []

    def victim(self):
        got = super().victim()
        view = self.view
        expect = reference_victim(self.pages, view.session_of, view.expected, view.droppable)
        lru = next((p for p in self.pages if view.droppable(p)), None)
        CheckedSession.calls.append((got, expect, lru))
        return got


def session_requests(num_sessions, seed=0):
    rng = np.random.default_rng(seed)
    reqs = []
    for s in range(num_sessions):
        t0 = float(rng.uniform(0, 200))
        ids = rng.integers(0, 512, int(rng.integers(8, 40))).tolist()
        num_turns = int(rng.integers(1, 8))
        for t in range(num_turns):
            if t:
                ids = ids + rng.integers(0, 512, int(rng.integers(4, 24))).tolist()
                t0 += float(rng.pareto(1.3) * 4.0)
            reqs.append(Request(
                f"s{s}t{t}", t0, len(ids), prompt_token_ids=list(ids),
                sampling=SamplingParams(max_tokens=int(rng.integers(1, 8)), ignore_eos=True),
                session_id=f"s{s}" if s % 5 else None, turn=t, more_turns=t < num_turns - 1 and s % 5 > 0,
            ))  # fmt: skip
    return sorted(reqs, key=lambda r: r.arrival_s)


def test_a_run_evicts_as_the_oracle_does():
    CheckedSession.calls = []
    sched = Scheduler(
        SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, preemption="swap", chunked_prefill=True),
        CacheConfig(num_pages=60, page_size=4, host_pages=48, num_swap_pages=16,
                    host_eviction=f"{__name__}:CheckedSession", host_prefetch=True),
        256,
    )  # fmt: skip
    serve(session_requests(120), sched, SimExecutor(UnitCost()), stretches=False)
    calls = CheckedSession.calls
    assert len(calls) > 500
    assert [got for got, _, _ in calls] == [expect for _, expect, _ in calls]
    assert any(expect != lru for _, expect, lru in calls)  # the sessions changed some choices
