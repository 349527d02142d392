"""Planning one iteration (no jax): which running requests go on, which waiting ones are
admitted and which are preempted, written out as the step's `Schedule`."""

from __future__ import annotations

from typing import Callable

from cbjax.config import SchedulerConfig
from cbjax.core.plan import Schedule
from cbjax.core.request import Request, Status
from cbjax.scheduler.output import Draft, PlanWriter
from cbjax.scheduler.policy import PolicyContract, SchedulerView
from cbjax.scheduler.results import StepResults
from cbjax.scheduler.running import RunningSet
from cbjax.scheduler.waiting import WaitingQueue


class Planner:
    """Plans each iteration over `running_set` and `waiting`, as `cfg` says (the step's token
    budget, hybrid batching, chunked prefill, static padding, swap preemption) and `policy`
    decides (admission, victims; it reads `view`), taking pages from `allocator` (sharing
    cached ones from `prefix`, or None) for `reserve_tokens(req)` tokens a reservation covers.
    `writer` writes each plan out; `drafts` gives the decodes their drafts. A preemption needs
    the step in flight committed (`results.uncommitted` empty)."""

    def __init__(
        self,
        cfg: SchedulerConfig,
        running_set: RunningSet,
        waiting: WaitingQueue,
        policy: PolicyContract,
        view: SchedulerView,
        allocator,
        prefix,
        writer: PlanWriter,
        reserve_tokens: Callable[[Request], int],
        results: StepResults,
        drafts=None,
    ):
        self.cfg = cfg
        self.token_budget = cfg.max_num_batched_tokens
        self.swap = cfg.preemption == "swap"
        self.running_set = running_set
        self.waiting = waiting
        self.policy = policy
        self.view = view
        self.allocator = allocator
        self.prefix = prefix
        self.writer = writer
        self.reserve_tokens = reserve_tokens
        self.results = results
        self.tier = prefix.tier if prefix is not None else None  # the host tier, or None
        self.drafts = drafts  # a Drafts, or None: no speculative decoding
        self.num_preemptions = 0
        self.num_swap_preemptions = 0
        self.num_swapped_out_pages = 0
        self._prefilled_last = False  # scheduler.alternate_phases: the last plan had prefill work
        # scheduler.static_padding: the current batch's rows, padded prompt length, decode steps
        self._pad_rows = 0
        self._pad_len = 0
        self._pad_step = 0

    def plan(self, now: float) -> Schedule:
        """The next iteration's plan; its admissions and preemptions take effect now."""
        plan = Draft()
        budget = self.token_budget
        # Running requests first: decodes (one token left to process), then unfinished
        # prefills, then new prefills: Sarathi-Serve's stall-free order. A request processes
        # tokens[num_computed : num_computed + num_new_tokens]. Without hybrid batching an
        # iteration with prefill work runs only that, and decodes wait for one without (or,
        # with alternate_phases, run in every other iteration while prefill work waits).
        hybrid = self.cfg.hybrid_batching
        if hybrid or (self.cfg.alternate_phases and self._prefilled_last):
            budget = self._plan_running(plan, True, budget)
        if hybrid or not plan.decodes:
            if len(plan.decodes) != len(self.running_set.running):  # else every running request decodes here
                budget = self._plan_running(plan, False, budget)
            new_batch = not self.running_set.running
            budget = self._admit_waiting(plan, budget, now)
        else:
            new_batch = False
        if not hybrid and not plan.prefills and not plan.decodes:
            self._plan_running(plan, True, budget)
        self._prefilled_last = bool(plan.prefills)
        if self.cfg.static_padding:
            self._pad(plan, new_batch)
        tier = self.tier
        if tier is not None and tier.prefetch and (plan.decodes or plan.prefills):  # an empty plan is never run
            self._prefetch(plan)
        schedule = self.writer.write(plan, now)
        if self.waiting.dropped and schedule.scheduled:  # only a plan with rows reaches the executor
            schedule.swap_drop, self.waiting.dropped = self.waiting.dropped, []
        if tier is not None:
            tier.flush(schedule)
        return schedule

    def continued(self) -> None:
        """A plan written without planning (a decode stretch's): it holds no prefill."""
        self._prefilled_last = False

    def _plan_running(self, plan: Draft, decoding: bool, budget: int) -> int:
        """Plan the running requests' decodes (`decoding`) or unfinished prefills, preempting
        when pages run out. Returns the budget left."""
        running_set = self.running_set
        if not decoding and len(plan.decodes) == len(running_set.running):
            return budget  # every running request decodes in this plan: no prefill is left
        alloc = self.allocator
        running = Status.RUNNING
        planned = plan.decodes if decoding else plan.prefills
        if decoding and budget >= len(running_set.running):
            # Every decode fits the budget: the decodes whose pages are free to take go in one
            # call, in running order; the loop below finds them planned and goes on from the
            # first that must wait for pages (or preempt), exactly as it would have reached it.
            decodes = [req for req in running_set.running if req.status is running and not req.num_new_tokens
                       and req.prompt_len + req.num_generated - req.num_computed == 1]  # fmt: skip
            num = alloc.try_append_one_each(decodes)
            took = decodes if num == len(decodes) else decodes[:num]
            for req in took:
                req.num_new_tokens = 1
            planned.extend(took)
            budget -= num
            if took is decodes:
                if self.drafts is not None:
                    budget = self.drafts.extend(planned, budget)
                return budget
        for req in list(running_set.running):
            if req.status is not running or req.num_new_tokens:
                continue  # preempted earlier in this loop, or already planned
            remaining = req.prompt_len + req.num_generated - req.num_computed  # num_tokens - num_computed
            if (remaining == 1) != decoding:
                continue
            n = remaining if remaining < budget else budget
            if n == 0:
                continue
            if not alloc.try_append(req.request_id, req.num_computed + n):
                while not alloc.can_append(req.request_id, req.num_computed + n):
                    victim = self.policy.choose_victim(running_set.running)
                    budget += self._preempt(victim, plan)
                    if victim is req:
                        break
                if req.status is not running:
                    continue
                alloc.append(req.request_id, req.num_computed + n)
            req.num_new_tokens = n
            budget -= n
            planned.append(req)
        if decoding and self.drafts is not None:
            budget = self.drafts.extend(planned, budget)
        return budget

    def _admit_waiting(self, plan: Draft, budget: int, now: float) -> int:
        """Admit waiting requests as the policy, slots, budget and pages allow; their prefills
        join the plan. Returns the budget left."""
        alloc = self.allocator
        if not self.policy.admission_open(self.view):
            return budget
        # Nothing preempted this iteration is readmitted in it.
        while len(self.policy) and budget > 0:
            req = self.policy.peek()
            if req in plan.preempted:
                break
            swapped = self.waiting.host_pages(req)
            cached = [] if swapped or self.prefix is None else self.prefix.match(req)
            hosts = self.prefix.match_host(req, len(cached)) if self.tier is not None and not swapped else ()
            done = req.num_computed if swapped else (len(cached) + len(hosts)) * alloc.page_size
            n = req.num_tokens - done
            if n > budget:
                # Chunked prefill (Sarathi-Serve) fills the budget's remainder with the
                # head's first chunk. Without it, only a recomputed request can outgrow the
                # whole budget (longer prompts are rejected): it is chunked the same way.
                if n <= self.token_budget and not self.cfg.chunked_prefill:
                    break
                n = budget
            reserve = self.reserve_tokens(req)
            if not self.running_set.num_free_slots or not alloc.can_allocate(done + n, reserve, cached):
                # The policy may evict a running request the head outranks (priority, mlfq).
                victim = self.policy.preempt_for(req, self.view)
                if victim is None:
                    break
                budget += self._preempt(victim, plan)
                continue
            self.waiting.take(req)
            if hosts:
                self.tier.pin(hosts)  # before the allocation's evictions may drop them
            table = alloc.allocate(req.request_id, done + n, reserve, cached)
            budget -= n
            if swapped:
                plan.swap_in.append((req, table[:swapped]))
            else:
                if self.prefix is not None:
                    self.prefix.admitted(req, done)
                    if self.tier is not None:
                        self.prefix.loaded(req, cached, hosts, table)
                req.num_computed = done
            self.running_set.admit(req, now)
            req.num_new_tokens = n
            plan.prefills.append(req)
        return budget

    def _prefetch(self, plan: Draft) -> None:
        """`cache.host_prefetch`: start loading the host pages of the first waiting requests (as
        many as there are slots), in queue order, into free device pages, leaving one page per
        running request for its next token."""
        room = self.allocator.num_free_pages - len(self.running_set.running)
        for i, req in enumerate(self.policy):
            if i >= self.cfg.max_num_seqs or room <= 0:
                break
            if req not in plan.preempted and not self.waiting.host_pages(req):
                room -= self.prefix.prefetch(req, room)

    def _pad(self, plan: Draft, new_batch: bool) -> None:
        """`scheduler.static_padding`: charge the plan as a padded `generate` batch runs. The
        iteration that forms a batch prefills every row padded to the batch's longest prompt;
        each later one decodes every row of the batch, finished rows included, at the padded
        length, until the last row finishes (the next batch then forms)."""
        if new_batch and plan.prefills:
            self._pad_rows = len(plan.prefills)
            self._pad_len = max(r.num_tokens for r in plan.prefills)
            self._pad_step = 0
            plan.padded_rows = [(self._pad_len, 0, False)] * self._pad_rows
            return
        self._pad_step += 1
        plan.padded_rows = [(1, self._pad_len + self._pad_step - 1, True)] * self._pad_rows

    def _preempt(self, req: Request, plan: Draft) -> int:
        """Preempt by swap (its computed pages to host memory, `num_computed` kept) or by
        recompute (its K/V dropped), and requeue it with its tokens so far.

        Returns the budget tokens it gives back if it was already planned this iteration.
        """
        if self.results.uncommitted is not None:
            raise RuntimeError("preemption with a step's tokens uncommitted (see needs_sync); this is a bug")
        planned = req.num_new_tokens
        if planned:
            (plan.decodes if req in plan.decodes else plan.prefills).remove(req)
            req.num_new_tokens = 0
        pages = self.allocator.pages_for(req.num_computed)
        swap_in = next((entry for entry in plan.swap_in if entry[0] is req), None)
        if swap_in is not None:
            plan.swap_in.remove(swap_in)  # swapped in by this plan: its host copy is still there
        elif self.tier is not None and self.tier.loading(req.request_id):
            pages = 0  # its pages are loaded only when the plan runs: nothing to swap out yet
        elif self.swap and 0 < pages <= self.waiting.swap_room():
            plan.swap_out.append((req, self.allocator.page_tables[req.request_id][:pages]))
            self.num_swap_preemptions += 1
            self.num_swapped_out_pages += pages
        else:
            pages = 0
        self.running_set.evict(req)
        req.status = Status.WAITING
        if not pages:
            req.num_computed = 0
        req.num_preemptions += 1
        self.num_preemptions += 1
        plan.preempted.append(req)
        self.waiting.requeue(req, pages)
        return planned
