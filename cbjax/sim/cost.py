"""Iteration cost models for the simulator: `unit` (1 s each), `roofline` (FLOPs vs bytes) and
`profiled` (fitted on the engine, `cbjax.sim.profiled`)."""

from __future__ import annotations

from typing import Optional

from cbjax.config import CacheConfig, ExecutorConfig, HardwareConfig, ModelConfig, SchedulerConfig
from cbjax.plan import Schedule
from cbjax.sim.tp import allreduce_bytes_per_token, ring_bytes_per_device


class UnitCost:
    """Every iteration costs exactly 1.0 s, so time counts iterations (swaps cost nothing)."""

    name = "unit"

    def __call__(self, plan: Schedule) -> float:
        return 1.0


class RooflineCost:
    """Iteration time = max(FLOPs / achievable FLOP/s, bytes / achievable bandwidth) + overhead
    (`hardware.overhead_s`, plus `hardware.overhead_s_per_seq` per scheduled sequence).

    FLOPs: 2 per weight per processed token in the transformer body, the LM head once per
    sequence (only the last position is sampled), and attention scores and mixing over each
    token's context. Bytes: all weights once per iteration, plus the K/V each sequence reads
    and writes. One forward serves every prefill and decode of the iteration, as in Orca.
    A prefill after a prefix-cache hit counts only its new tokens (the hit is its context).
    The rows charged are `Schedule.cost_rows`: a padded static batch charges its padding.

    `hardware.page_overhead_s` adds a fixed cost per KV page each row reads (its context and
    new tokens, in pages of `plan.page_size`).

    Tensor parallelism over `hardware.num_devices` devices splits FLOPs, weights and K/V
    evenly and adds, serially, two ring all-reduces of the iteration's activations per layer
    (after attention and after the MLP), each moving 2(n-1)/n of the activation bytes per
    device over `hardware.interconnect_bw`.

    Swap preemption adds the swapped pages' K/V bytes over `hardware.host_bw` (each device
    its shard over its own link), plus `hardware.host_copy_latency_s` per copy call, one per
    page, layer and K or V, serially: the copies run before the step.
    """

    name = "roofline"

    def __init__(self, model: ModelConfig, hw: HardwareConfig):
        n = hw.num_devices
        self.overhead_s = hw.overhead_s
        self.overhead_s_per_seq = hw.overhead_s_per_seq
        self.page_overhead_s = hw.page_overhead_s
        self.flops_per_s = hw.peak_flops * hw.flops_efficiency * n
        self.bytes_per_s = hw.mem_bw * hw.bw_efficiency * n
        head = model.vocab_size * model.d_model
        embed = head * (1 if model.tie_embeddings else 2)
        self.body_flops_per_token = 2.0 * (model.num_params - embed)
        self.head_flops_per_seq = 2.0 * head
        # q.k and p.v, per (query, key) pair, all layers and heads
        self.attn_flops_per_pair = 4.0 * model.num_layers * model.num_heads * model.head_dim
        self.weight_bytes = float(model.num_params * model.dtype_bytes)
        self.kv_bytes_per_token = float(model.kv_bytes_per_token)
        self.host_bytes_per_s = hw.host_bw * n
        self.copy_s_per_page = 2 * model.num_layers * hw.host_copy_latency_s
        # all-reduce seconds per processed token: the bytes the engine all-reduces (cbjax.sim.tp)
        self.allreduce_s_per_token = ring_bytes_per_device(allreduce_bytes_per_token(model), n) / hw.interconnect_bw
        if self.weight_bytes / n > hw.mem_bytes:
            split = f" per device (hardware.num_devices={n})" if n > 1 else ""
            raise ValueError(
                f"model {model.name} needs {self.weight_bytes / n / 1e9:.1f} GB of weights{split}, "
                f"hardware {hw.name} has {hw.mem_bytes / 1e9:.1f} GB"
            )

    def __call__(self, plan: Schedule) -> float:
        tokens = 0
        seqs = 0
        pairs = 0.0
        kv_tokens = 0
        pages = 0
        ps = plan.page_size
        for n, ctx, decode in plan.cost_rows():
            seqs += 1
            tokens += n
            pairs += n * ctx + n * (n + 1) / 2  # a decode: its context plus the new token
            kv_tokens += ctx + n + (1 if decode else 0)  # a decode reads its context, writes one
            pages += -(-(ctx + n) // ps)
        flops = tokens * self.body_flops_per_token + seqs * self.head_flops_per_seq + pairs * self.attn_flops_per_pair
        bytes_moved = self.weight_bytes + kv_tokens * self.kv_bytes_per_token
        swapped = plan.num_swapped_pages
        swap_s = swapped * (plan.page_size * self.kv_bytes_per_token / self.host_bytes_per_s + self.copy_s_per_page)
        compute_s = max(flops / self.flops_per_s, bytes_moved / self.bytes_per_s)
        host_s = self.overhead_s + plan.num_scheduled * self.overhead_s_per_seq
        attn_pages_s = pages * self.page_overhead_s
        return compute_s + attn_pages_s + tokens * self.allreduce_s_per_token + host_s + swap_s


def _profiled(
    model: ModelConfig,
    hw: HardwareConfig,
    *,
    scheduler: Optional[SchedulerConfig] = None,
    cache: Optional[CacheConfig] = None,
    executor: Optional[ExecutorConfig] = None,
):
    from cbjax.sim.profiled import make_profiled_cost

    if scheduler is None or cache is None or executor is None:
        raise ValueError("executor.cost_model=profiled: make_cost_model needs scheduler, cache and executor")
    return make_profiled_cost(model, scheduler, cache, executor)


_profiled.needs_run = True  # built from the run's scheduler, cache and executor configs too

# executor.cost_model names -> factories of (model, hardware); the one list the config checks.
# A factory with `needs_run` also gets the run's scheduler, cache and executor configs.
COST_MODELS = {
    "unit": lambda model, hw: UnitCost(),
    "roofline": RooflineCost,
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
):
    """The cost model `name`; `profiled` also needs the run's scheduler, cache and executor configs
    (the engine's shape plan and the profile path)."""
    if name in COST_MODELS:
        factory = COST_MODELS[name]
        if getattr(factory, "needs_run", False):
            return factory(model, hw, scheduler=scheduler, cache=cache, executor=executor)
        return factory(model, hw)
    raise ValueError(f"executor.cost_model: unknown value {name!r}; choose one of {', '.join(COST_MODELS)}")
