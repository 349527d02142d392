"""Speculative decoding in the scheduler (no jax): drafts planned beside each decode, and the
accepted ones taken in after the step.

Planning (`extend`, once the plan's decodes hold their own token each): the speculation policy
picks k for the step (`cbjax.spec.policy`); each decode, in plan order, then verifies
d = min(k, the token budget left, its remaining length less its own token, what its pages and
the free pages hold) drafts, and with n-gram drafts on an engine at most what the lookup found
(`cbjax.spec.ngram`); a simulated run replaying an acceptance trace proposes at most what the
trace's request proposed at that step. Its 1 + d tokens are charged to the budget and its pages
for them appended before the step, so the pool shows them; drafts never preempt.

After the step (`settle`, before the step's ordinary bookkeeping), a decode whose a drafts were
accepted yields them and the target's token after them: `num_computed` grows by 1 + a,
`num_generated` by a + 1. Stop tokens are checked token by token through them, the rest dropped.
The rejected positions' K/V stays in the request's pages as garbage a later step overwrites;
the allocator's stored tokens follow `num_computed` back, and the prefix cache registers only
pages of accepted tokens (it registers after this rollback). A preempted request's drafts are
dropped with its step.
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

from cbjax.config.spec import SpecConfig
from cbjax.core.plan import Schedule, ScheduledRequest
from cbjax.core.request import Request, Status
from cbjax.spec.ngram import propose_ngram
from cbjax.spec.policy import SpecPolicy, SpecView, draft_room
from cbjax.spec.trace import read_trace


class Drafts:
    """Drafts for the decodes of `running_set` under `spec` and its `policy`, pages from
    `allocator`, rows written by `writer` (its `drafts`); `queue` is the waiting queue (its
    length) and `step_cost(plan)` a step's seconds for the policy's view (None: no cost model).
    A stop on one of `eos_token_ids` (unless ignored) or a request's stop ids ends it mid-step."""

    def __init__(self, spec: SpecConfig, policy: SpecPolicy, allocator, writer, running_set, queue,
                 step_cost: Optional[Callable[[Schedule], float]], eos_token_ids: frozenset[int]):  # fmt: skip
        self.spec, self.policy, self.step_cost = spec, policy, step_cost
        self.allocator, self.writer = allocator, writer  # where drafts go: pages, plan rows
        self.running_set, self.queue = running_set, queue  # the load the policy's view reports
        self.eos_token_ids = eos_token_ids
        self.max_drafts = spec.num_tokens
        self.ngram = spec.method == "ngram"
        self.trace = read_trace(spec.acceptance_path) if spec.acceptance == "trace" else None
        # the run's drafts: proposed, accepted, and tried (accepted, or the first rejected of a
        # verification: the trials of an independent per-draft acceptance)
        self.num_proposed = 0
        self.num_accepted = 0
        self.num_tried = 0

    @property
    def acceptance_rate(self) -> Optional[float]:
        return self.num_accepted / self.num_tried if self.num_tried else None

    # ---- planning ----
    def extend(self, decodes: list[Request], budget: int) -> int:
        """Give the plan's `decodes` (one token each so far) their drafts; the budget left."""
        if not decodes or budget <= 0:
            return budget
        view = SpecView(tuple(decodes), len(self.running_set.running), len(self.queue), self.max_drafts,
                        self.acceptance_rate, self._pricer(decodes) if self.step_cost is not None else None)  # fmt: skip
        k = self.policy.num_drafts(view)
        if not (isinstance(k, int) and 0 <= k <= self.max_drafts):
            raise ValueError(f"spec.policy: {type(self.policy).__name__}.num_drafts returned {k!r}, "
                             f"not an int in [0, spec.num_tokens={self.max_drafts}]")  # fmt: skip
        if not k:
            return budget
        alloc, drafts = self.allocator, self.writer.drafts
        with_ids = self.writer.token_ids
        ngram = self.ngram and with_ids
        trace = self.trace if not with_ids else None
        for req in decodes:
            if budget <= 0:
                break
            d = min(k, budget, draft_room(req))
            if d <= 0:
                continue
            ids: tuple[int, ...] = ()
            if ngram:
                s = self.spec
                ids = propose_ngram(req.prompt_ids() + req.output_token_ids, d, s.ngram_min, s.ngram_max)
                d = len(ids)
            elif trace is not None:
                proposed, _ = trace.get(req.request_id, _NO_TRACE).at(len(req.spec_steps or ()))
                d = min(d, proposed)
            if d <= 0:
                continue
            rid, computed = req.request_id, req.num_computed
            if not alloc.try_append(rid, computed + 1 + d):
                while d > 0 and not alloc.can_append(rid, computed + 1 + d):
                    d -= 1
                if not d:
                    continue
                alloc.append(rid, computed + 1 + d)
                ids = ids[:d]
            req.num_new_tokens = 1 + d
            budget -= d
            drafts[rid] = (d, ids)
        return budget

    def _pricer(self, decodes: list[Request]) -> Callable[[int], float]:
        """`SpecView.step_s`: the step of `decodes` alone, each verifying k drafts as far as its
        length allows, priced by the cost model."""
        num_slots, page_size, cost = self.writer.num_slots, self.allocator.page_size, self.step_cost

        def step_s(k: int) -> float:
            rows = []
            for r in decodes:
                d = min(k, draft_room(r))
                rows.append(ScheduledRequest(r.request_id, r.slot, r.num_computed, 1 + d, True, None, False, None,
                                             None, True, d))  # fmt: skip
            return cost(Schedule(num_slots, rows, [], 0.0, [], [], page_size))

        return step_s

    # ---- results ----
    def settle(
        self,
        plan: Schedule,
        requests: list[Request],
        token_ids: Optional[Sequence[int]],
        num_accepted: Optional[Sequence[int]],
        accepted_ids: Optional[Sequence[Sequence[int]]],
        errors: Optional[dict[int, str]],
    ) -> Optional[Sequence[int]]:
        """Take in the step's verifications, before its ordinary bookkeeping: each decode that
        accepted a drafts (and whose token ids, where the executor reads ids, stop nowhere
        among them) is left for that bookkeeping as a one-token step of `1 + a` new tokens, its
        accepted ids already appended. Returns `token_ids` with each row's last kept token (a
        stop token the row ended on replaces the target's own)."""
        running = Status.RUNNING
        alloc, policy = self.allocator, self.policy
        out_ids = None
        for i, row in enumerate(plan.scheduled):
            if not row.is_decode:
                break  # decodes come first
            req = requests[i]
            if req.status is not running or (errors and i in errors):
                continue
            d = row.num_drafts
            a = num_accepted[i] if d and num_accepted is not None else 0
            if not 0 <= a <= d:
                raise RuntimeError(f"request {req.request_id}: {a} drafts accepted of {d} verified; this is a bug")
            steps = req.spec_steps
            if steps is None:
                steps = req.spec_steps = []
            steps.append((d, a))
            if not d:
                continue
            self.num_proposed += d
            self.num_accepted += a
            self.num_tried += a + (a < d)
            req.spec_proposed += d
            req.spec_accepted += a
            policy.on_verified(req, d, a)
            kept = a
            if token_ids is not None:
                if a and (accepted_ids is None or len(accepted_ids[i]) < a):
                    raise RuntimeError(f"request {req.request_id}: the executor accepted {a} drafts "
                                       "without their ids (StepOutput.accepted_ids); this is a bug")  # fmt: skip
                tokens = (list(accepted_ids[i][:a]) if a else []) + [int(token_ids[i])]
                kept = next((j for j, tok in enumerate(tokens[:a]) if self._stops(req, tok)), a)
                req.output_token_ids.extend(tokens[:kept])
                if out_ids is None:
                    out_ids = list(token_ids)
                out_ids[i] = tokens[kept]
            req.num_generated += kept
            req.num_new_tokens = 1 + kept
            alloc.append(req.request_id, row.num_computed + 1 + kept)  # stored tokens: the kept ones
        return out_ids if out_ids is not None else token_ids

    def _stops(self, req: Request, tok: int) -> bool:
        """Whether `tok` ends `req` (as `StepResults._take_token` judges it)."""
        return tok in req.sampling.stop_token_ids or (tok in self.eos_token_ids and not req.sampling.ignore_eos)


class _NoTrace:
    """A request the trace does not hold: it proposes nothing."""

    @staticmethod
    def at(step: int) -> tuple[int, int]:
        return 0, 0


_NO_TRACE = _NoTrace()
