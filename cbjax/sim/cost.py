"""Iteration cost models for the simulator: `unit` (1 s each) and `roofline` (FLOPs vs bytes)."""

from __future__ import annotations

from cbjax.config import HardwareConfig, ModelConfig
from cbjax.scheduler.core import Schedule


class UnitCost:
    """Every iteration costs exactly 1.0 s, so time counts iterations (swaps cost nothing)."""

    name = "unit"

    def __call__(self, plan: Schedule) -> float:
        return 1.0


class RooflineCost:
    """Iteration time = max(FLOPs / achievable FLOP/s, bytes / achievable bandwidth) + overhead.

    FLOPs: 2 per weight per processed token in the transformer body, the LM head once per
    sequence (only the last position is sampled), and attention scores and mixing over each
    token's context. Bytes: all weights once per iteration, plus the K/V each sequence reads
    and writes. One forward serves every prefill and decode of the iteration, as in Orca.
    A prefill after a prefix-cache hit counts only its new tokens (the hit is its context).
    Swap preemption adds the swapped pages' K/V bytes over `hardware.host_bw`, serially: the
    copies run before the step.
    """

    name = "roofline"

    def __init__(self, model: ModelConfig, hw: HardwareConfig):
        self.overhead_s = hw.overhead_s
        self.flops_per_s = hw.peak_flops * hw.flops_efficiency
        self.bytes_per_s = hw.mem_bw * hw.bw_efficiency
        head = model.vocab_size * model.d_model
        embed = head * (1 if model.tie_embeddings else 2)
        self.body_flops_per_token = 2.0 * (model.num_params - embed)
        self.head_flops_per_seq = 2.0 * head
        # q.k and p.v, per (query, key) pair, all layers and heads
        self.attn_flops_per_pair = 4.0 * model.num_layers * model.num_heads * model.head_dim
        self.weight_bytes = float(model.num_params * model.dtype_bytes)
        self.kv_bytes_per_token = float(model.kv_bytes_per_token)
        self.host_bytes_per_s = hw.host_bw
        if self.weight_bytes > hw.mem_bytes:
            raise ValueError(
                f"model {model.name} needs {self.weight_bytes / 1e9:.1f} GB of weights, "
                f"hardware {hw.name} has {hw.mem_bytes / 1e9:.1f} GB"
            )

    def __call__(self, plan: Schedule) -> float:
        tokens = 0
        pairs = 0.0
        kv_tokens = 0
        for req in plan.decodes:
            ctx = req.num_computed  # keys attended: the context plus the new token
            pairs += ctx + 1
            kv_tokens += ctx + 2  # read the context, write the new token
        tokens += len(plan.decodes)
        for req in plan.prefills:
            n = req.num_new_tokens
            ctx = req.num_computed
            tokens += n
            pairs += n * ctx + n * (n + 1) / 2
            kv_tokens += ctx + n
        seqs = plan.num_scheduled
        flops = tokens * self.body_flops_per_token + seqs * self.head_flops_per_seq + pairs * self.attn_flops_per_pair
        bytes_moved = self.weight_bytes + kv_tokens * self.kv_bytes_per_token
        swap_s = plan.num_swapped_pages * plan.page_size * self.kv_bytes_per_token / self.host_bytes_per_s
        return max(flops / self.flops_per_s, bytes_moved / self.bytes_per_s) + self.overhead_s + swap_s


# executor.cost_model names -> factories of (model, hardware); the one list the config checks.
COST_MODELS = {
    "unit": lambda model, hw: UnitCost(),
    "roofline": RooflineCost,
}


def make_cost_model(name: str, model: ModelConfig, hw: HardwareConfig):
    if name in COST_MODELS:
        return COST_MODELS[name](model, hw)
    raise ValueError(f"executor.cost_model: unknown value {name!r}; choose one of {', '.join(COST_MODELS)}")
