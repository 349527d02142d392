"""Iteration cost models for the simulator: `unit` (1 s each), `roofline` (FLOPs vs bytes) and
`profiled` (fitted on the engine, `cbjax.sim.profiled`)."""

from __future__ import annotations

from operator import itemgetter, mul
from typing import NamedTuple, Optional

import numpy as np

from cbjax.config import CacheConfig, ExecutorConfig, HardwareConfig, ModelConfig, OverheadConfig, SchedulerConfig, SpecConfig
from cbjax.core.plan import Schedule, ScheduledRequest
from cbjax.core.timing import NO_CONTEXT, StepContext, StepTime
from cbjax.sim.tp import allreduce_bytes_per_token, ring_bytes_per_device


_INF = float("inf")
# a plan row's num_new_tokens, num_computed and is_decode, read without attribute lookups
_NEW, _CONTEXT, _IS_DECODE = (itemgetter(ScheduledRequest._fields.index(f)) for f in ("num_new_tokens", "num_computed", "is_decode"))
# a stretch priced whole (no `until`) longer than this is priced on arrays
_VECTOR_STEPS = 64


class UnitCost:
    """Every iteration costs exactly 1.0 s, so time counts iterations (swaps cost nothing)."""

    name = "unit"
    history = 0
    _STEP = StepTime(1.0)

    def __call__(self, plan: Schedule, ctx: StepContext = NO_CONTEXT) -> StepTime:
        return self._STEP


class RooflineCost:
    """Iteration time = the weight matmuls' roofline plus attention's, each max(FLOPs /
    achievable FLOP/s, bytes / achievable bandwidth), plus the serving stack's host costs
    (`StackOverhead`: the `overhead` group, 0 under `overhead=none`).

    Weight matmuls: 2 FLOPs per weight per processed token in the transformer body, the LM
    head once per sequence (only the last position is sampled; with `verify`, a decode
    verifying drafts runs it at each of its 1 + d positions); all weights read once per
    iteration. Attention: scores and mixing over each token's context; the K/V each sequence
    reads and writes. The two are separate kernels that run one after the other in every
    layer, so neither hides behind the other: a large batch's matmuls can be bound by compute
    while its decodes' attention is bound by memory, and the step pays both. (Within one kind
    the bound is the larger of the two.) One forward serves every prefill and decode of the
    iteration, as in Orca.
    A prefill after a prefix-cache hit counts only its new tokens (the hit is its context).
    The rows charged are `Schedule.cost_rows`: a padded static batch charges its padding.

    Tensor parallelism over `hardware.num_devices` devices splits FLOPs, weights and K/V
    evenly and adds, serially, two ring all-reduces of the iteration's activations per layer
    (after attention and after the MLP), each moving 2(n-1)/n of the activation bytes per
    device over `hardware.interconnect_bw`.

    Swap preemption adds the swapped pages' K/V bytes over `hardware.host_bw` (each device
    its shard over its own link); the stack's copy calls are `StackOverhead`'s. The host KV
    tier's stores and loads (`Schedule.host_copies`) cost the same bytes over the same link
    and the same copy calls (`StackOverhead.tier_copy_s`), before the step; its prefetches,
    priced alike, run beside it (`StepTime.prefetch_s`).
    """

    name = "roofline"
    history = 0

    def __init__(
        self, model: ModelConfig, hw: HardwareConfig, overhead: Optional[OverheadConfig] = None, verify: bool = False
    ):
        n = hw.num_devices
        self.verify = verify  # speculative decoding: heads at every position of a verifying decode
        self.stack = StackOverhead(model, overhead or OverheadConfig())
        self.flops_per_s = hw.peak_flops * hw.flops_efficiency * n
        self.bytes_per_s = hw.mem_bw * hw.bw_efficiency * n
        head = model.vocab_size * model.d_model
        embed = head * (1 if model.tie_embeddings else 2)
        self.body_flops_per_token = 2.0 * (model.num_params - embed)
        self.head_flops_per_seq = 2.0 * head
        # q.k and p.v, per (query, key) pair, all layers and heads
        self.attn_flops_per_pair = 4.0 * model.num_layers * model.num_heads * model.head_dim
        self.weight_bytes = float(model.num_params * model.dtype_bytes)
        self.weight_s = self.weight_bytes / self.bytes_per_s  # the weight matmuls' memory bound
        self.kv_bytes_per_token = float(model.kv_bytes_per_token)
        self.host_bytes_per_s = hw.host_bw * n
        # all-reduce seconds per processed token: the bytes the engine all-reduces (cbjax.sim.tp)
        self.allreduce_s_per_token = ring_bytes_per_device(allreduce_bytes_per_token(model), n) / hw.interconnect_bw
        if self.weight_bytes / n > hw.mem_bytes:
            split = f" per device (hardware.num_devices={n})" if n > 1 else ""
            raise ValueError(
                f"model {model.name} needs {self.weight_bytes / n / 1e9:.1f} GB of weights{split}, "
                f"hardware {hw.name} has {hw.mem_bytes / 1e9:.1f} GB"
            )

    def __call__(self, plan: Schedule, ctx: StepContext = NO_CONTEXT) -> StepTime:
        tokens = 0
        pairs = 0.0
        kv_tokens = 0
        if plan.padded_rows is None:  # plan.cost_rows(), read off the entries in C-level passes
            rows = plan.scheduled
            num_rows = len(rows)
            ns = list(map(_NEW, rows))
            ctxs = list(map(_CONTEXT, rows))
            tokens = sum(ns)
            # sum(n * ctx + n (n + 1) / 2): a decode, its context plus the new token. Whole
            # numbers far below 2**53: summed as ints, the same float as summed row by row.
            pairs = float(sum(map(mul, ns, ctxs)) + (sum(map(mul, ns, ns)) + tokens) // 2)
            # a decode reads its context and writes one
            kv_tokens = sum(ctxs) + tokens + sum(map(_IS_DECODE, rows))
        else:
            num_rows = len(plan.padded_rows)
            for n, ctx, decode in plan.padded_rows:
                tokens += n
                pairs += n * ctx + n * (n + 1) / 2
                kv_tokens += ctx + n + (1 if decode else 0)
        heads = num_rows
        if self.verify and plan.padded_rows is None:
            for s in plan.scheduled:
                heads += s.num_drafts
        matmul_s = self._matmul_s(tokens, heads)
        attn_s = pairs * self.attn_flops_per_pair / self.flops_per_s
        kv_s = kv_tokens * self.kv_bytes_per_token / self.bytes_per_s
        compute_s = matmul_s + (attn_s if attn_s >= kv_s else kv_s)
        if plan.swap_out or plan.swap_in:
            swap_s = plan.num_swapped_pages * plan.page_size * self.kv_bytes_per_token / self.host_bytes_per_s
        else:
            swap_s = 0.0
        host_s = self.stack.host_s(plan) if self.stack.active else 0.0
        if plan.host_copies is not None:
            store_s, load_s, prefetch_s = host_copy_times(plan, self.host_page_s)
            return StepTime(compute_s + tokens * self.allreduce_s_per_token, host_s, swap_s + store_s + load_s,
                            0.0, None, load_s, prefetch_s)  # fmt: skip
        return StepTime(compute_s + tokens * self.allreduce_s_per_token, host_s, swap_s)

    def _matmul_s(self, tokens: int, heads: int) -> float:
        """The weight matmuls' time for `tokens` processed tokens and `heads` LM-head rows: the
        larger of their FLOP time and the weights' read time."""
        matmul_s = (tokens * self.body_flops_per_token + heads * self.head_flops_per_seq) / self.flops_per_s
        return matmul_s if matmul_s >= self.weight_s else self.weight_s

    def host_page_s(self, num_pages: int, page_size: int) -> float:
        """Seconds to copy `num_pages` pages' K/V between device and host memory, the stack's
        copy calls included."""
        return num_pages * page_size * self.kv_bytes_per_token / self.host_bytes_per_s + self.stack.tier_copy_s(num_pages)


    def stretch_s(
        self, plan: Schedule, ctx: StepContext, start: float, until: float, num_steps: int
    ) -> Optional[list[float]]:
        """The `total_s` of each step of a decode stretch from `plan` (one step of decodes; step
        j each row j tokens further) that begins before `until`, the first at `start`, at most
        `num_steps`: as `__call__` prices them one by one, and as the clock sums their ends. A
        step's sums over its rows grow by one per row and step, and those sums are whole numbers
        that floats hold exactly, so each step is priced from the first step's sums. None where a
        step's host time depends on its pages (`overhead.page_s`), and for a plan no decode
        stretch writes (padded, verifying drafts, swapping or copying): price those one by one."""
        if self.stack.active and self.stack.config.page_s:
            return None
        if self.verify or plan.padded_rows is not None or plan.host_copies is not None or plan.swap_out or plan.swap_in:
            return None
        if num_steps <= 0 or start >= until:
            return []
        # `__call__`'s sums for a plan of decodes, each row one token on its context
        rows = len(plan.scheduled)
        pairs = 0.0
        kv_tokens = 0
        for s in plan.scheduled:
            pairs += s.num_computed + 1.0  # a decode's context plus the new token
            kv_tokens += s.num_computed + 2  # it reads its context and writes one
        attn, kv_bytes, flops_per_s, bytes_per_s = self.attn_flops_per_pair, self.kv_bytes_per_token, self.flops_per_s, self.bytes_per_s
        matmul_s = self._matmul_s(rows, rows)  # one token and one head a row in every step: the same throughout
        host_s = self.stack.host_s(plan) if self.stack.active else 0.0
        allreduce_s = rows * self.allreduce_s_per_token
        if until == _INF and num_steps > _VECTOR_STEPS:
            # a long stretch priced whole: the same operations on arrays (elementwise, and
            # summed in order), the same floats
            grown = np.arange(num_steps, dtype=np.int64) * rows
            attn_s = (pairs + grown) * attn / flops_per_s
            kv_s = (kv_tokens + grown) * kv_bytes / bytes_per_s
            return (((matmul_s + np.maximum(attn_s, kv_s)) + allreduce_s) + host_s).tolist()
        out = []
        append = out.append
        t = start
        for _ in range(num_steps):
            attn_s = pairs * attn / flops_per_s
            kv_s = kv_tokens * kv_bytes / bytes_per_s
            # StepTime(...).total_s, whose + copy_s (0.0) leaves a positive sum as it is
            d = ((matmul_s + (attn_s if attn_s >= kv_s else kv_s)) + allreduce_s) + host_s
            append(d)
            t += d
            if t >= until:
                break
            pairs += rows  # whole numbers: exact
            kv_tokens += rows
        return out


def host_copy_times(plan: Schedule, pages_s) -> tuple[float, float, float]:
    """(store, load, prefetch) seconds of `plan`'s host-tier copies, `pages_s(num_pages,
    page_size)` for each kind's pages."""
    copies, ps = plan.host_copies, plan.page_size
    return pages_s(len(copies.store), ps), pages_s(copies.num_loaded, ps), pages_s(copies.num_prefetched, ps)


class StackOverhead:
    """A serving stack's host costs around a step (`cbjax.config.overhead`): `step_s` per
    iteration, `seq_s` per scheduled sequence, `page_s` per KV page each row reads (its context
    and new tokens, in pages of `plan.page_size`), and `copy_latency_s` per swap copy call, one
    per page, layer and K or V, serially: the copies run before the step."""

    def __init__(self, model: ModelConfig, overhead: OverheadConfig):
        self.config = overhead
        self.active = not overhead.is_none  # host_s is 0.0 otherwise
        self.copy_s_per_page = 2 * model.num_layers * overhead.copy_latency_s

    def tier_copy_s(self, num_pages: int) -> float:
        """The copy calls of `num_pages` pages of the host KV tier (as a swap's: per page,
        layer and K or V); the roofline and `WithOverhead` put them with the tier's copies."""
        return num_pages * self.copy_s_per_page

    def host_s(self, plan: Schedule, rows=None) -> float:
        """Seconds the stack adds to `plan`'s step; `rows`: `plan.cost_rows()` if already built."""
        o = self.config
        if not self.active:
            return 0.0
        seconds = o.step_s + plan.num_scheduled * o.seq_s + plan.num_swapped_pages * self.copy_s_per_page
        if o.page_s:
            ps = plan.page_size
            pages = sum(-(-(ctx + n) // ps) for n, ctx, _ in (plan.cost_rows() if rows is None else rows))
            seconds += pages * o.page_s
        return seconds


class WithOverhead:
    """A cost model plus a stack's host costs (the profiled model's steps hold the engine's own
    host time already; this adds a different stack's on top when one is selected). Nothing
    hides the stack's host time, so a drained step keeps it too."""

    def __init__(self, cost, model: ModelConfig, overhead: OverheadConfig):
        self.cost = cost
        self.name = cost.name
        self.history = cost.history
        self.stack = StackOverhead(model, overhead)

    def __call__(self, plan: Schedule, ctx: StepContext = NO_CONTEXT) -> StepTime:
        t = self.cost(plan, ctx)
        host = self.stack.host_s(plan)
        drain = t.drain_s + host if t.drain_s is not None else None
        copy, load, prefetch = t.copy_s, t.load_s, t.prefetch_s
        if plan.host_copies is not None:  # the stack's calls for the host tier's copies
            store_s, load_s, prefetch_s = host_copy_times(plan, lambda n, ps: self.stack.tier_copy_s(n))
            copy, load, prefetch = copy + store_s + load_s, load + load_s, prefetch + prefetch_s
        return t._replace(host_s=t.host_s + host, copy_s=copy, drain_s=drain, load_s=load, prefetch_s=prefetch)


class RunParts(NamedTuple):
    """The run's configs a cost model may be built from besides the model and the hardware
    (None where the caller has none)."""

    scheduler: Optional[SchedulerConfig] = None
    cache: Optional[CacheConfig] = None
    executor: Optional[ExecutorConfig] = None
    overhead: Optional[OverheadConfig] = None  # the serving stack's host costs; None: overhead=none
    spec: Optional[SpecConfig] = None  # speculative decoding; None: off


def _profiled(model: ModelConfig, hw: HardwareConfig, run: RunParts):
    from cbjax.sim.profiled import make_profiled_cost

    if run.scheduler is None or run.cache is None or run.executor is None:
        raise ValueError("executor.cost_model=profiled: make_cost_model needs scheduler, cache and executor")
    cost = make_profiled_cost(model, run.scheduler, run.cache, run.executor)
    return cost if run.overhead is None or run.overhead.is_none else WithOverhead(cost, model, run.overhead)


# executor.cost_model names -> factories of (model, hardware, RunParts); the one list the
# config is checked against (`cbjax.app.choices`).
COST_MODELS = {
    "unit": lambda model, hw, run: UnitCost(),
    "roofline": lambda model, hw, run: RooflineCost(model, hw, run.overhead, verify=run.spec is not None and run.spec.enabled),
    "profiled": _profiled,
}


def make_cost_model(
    name: str,
    model: ModelConfig,
    hw: HardwareConfig,
    *,
    scheduler: Optional[SchedulerConfig] = None,
    cache: Optional[CacheConfig] = None,
    executor: Optional[ExecutorConfig] = None,
    overhead: Optional[OverheadConfig] = None,
    spec: Optional[SpecConfig] = None,
):
    """The cost model `name`; `profiled` also needs the run's scheduler, cache and executor configs
    (the engine's shape plan and the profile path); `overhead` is the serving stack's host costs
    (None: `overhead=none`), which `roofline` and `profiled` add. With `spec` a draft model
    (`spec.method=draft`), its proposals are charged too (`cbjax.sim.drafting`)."""
    if name not in COST_MODELS:
        raise ValueError(f"executor.cost_model: unknown value {name!r}; choose one of {', '.join(COST_MODELS)}")
    cost = COST_MODELS[name](model, hw, RunParts(scheduler, cache, executor, overhead, spec))
    if spec is not None and spec.method == "draft" and name != "unit":
        cost = _with_draft_model(cost, name, model, hw, spec)
    return cost


def _with_draft_model(cost, name: str, model: ModelConfig, hw: HardwareConfig, spec: SpecConfig):
    """`cost` (the cost model `name` of the target `model`) with the draft model's proposals
    charged (`cbjax.sim.drafting`): by the draft's roofline, or by the target's steps scaled by
    the draft's share of its parameters."""
    from cbjax.config.spec import draft_model_config
    from cbjax.sim.drafting import WithDraftModel

    draft = draft_model_config(spec, model)
    separate = spec.draft_model is not None
    if name == "roofline":
        roofline = RooflineCost(draft, hw)
        return WithDraftModel(cost, lambda plan: roofline(plan).device_s, separate)
    share = draft.num_params / model.num_params
    return WithDraftModel(cost, lambda plan: share * cost(plan).device_s, separate)
