"""The `profiled` cost model: a step's time fitted on this machine's engine (`python -m cbjax.profile`).

An iteration is charged for what `cbjax.runtime.executor.JaxExecutor` would run: its token
bucket (the padded flat buffer: one compiled program each), its rows, and the attention's work
over pages (`*_chunk_s`: each inner loop step of the XLA ragged attention runs a whole chunk of
query groups, counted exactly as `cbjax.layout.tiles.build_tiles` lays them out, `count_steps`;
the native decode pass is charged per group), plus its swap copies:

    step = fixed(bucket) + iter_s + seq_s * rows + token_s * tokens
           + (single_chunk_s + single_chunk_token_s * bucket) * single_steps   (native: single groups, token term 0)
           + (block_chunk_s + block_chunk_token_s * bucket) * block_steps
           + single_page_s * single_pages + block_page_s * block_pages  (KV pages really read)
    fixed(bucket) = served_bucket_s[bucket]  where the profile served enough steps of the bucket,
                    else bucket_scale * bucket_s[bucket]  (the grid's timing of the bucket's program
                    on an all-padding batch, scaled to the served steps)
    time = step
           + (swap_iter_s + swap_page_s * pages) if the plan swaps
           + (swap_out_iter_s + swap_out_page_s * pages) if it stores host-tier pages, and
             (swap_in_iter_s + swap_in_page_s * pages) if it loads some (each direction's own
             fit of the swap copies, which the host tier's copies are; the swap terms where a
             profile lacks them); its prefetches are priced as loads, beside the step
           + loop_s + loop_seq_s * requests  (the serving loop's own host time around the step:
             scheduling, postprocess, stats; it grows with the requests the iteration serves)
           + (wake_s + wake_token_s * tokens) * min(1, idle / wake_ramp_s)  on the first step
             after the loop idled for `idle` seconds waiting for an arrival (the loop's sleep
             overshoots, its plan and launch meet nothing to hide behind, and a CPU's threads
             and caches go cold: `cbjax.profile.wake`)
           + cold_s, cold2_s, cold3_s or cold4_s  on the 1st, 2nd, 3rd or 4th step after the
             last step of a larger bucket (a small step runs slower for a few steps after a
             large one; a run of same-bucket steps, as a static batch's decodes, is warm)
    launch = launch_iter_s + launch_seq_s * rows + launch_prefill_s * (any prefill rows)
             + launch_prefill_seq_s * prefill rows + launch_token_s * tokens
             + launch_cached_seq_s * rows  (with the prefix cache on: its work per row, matching
               and registering pages, hashing the known ones)
             + launch_left_s * left  (`rows_left`: the requests of the step in flight this plan
               does not carry on, finished or preempted; their retirement, pages freed and
               finish reported, falls in the same host time)
             (`launch_s`: the pipelined loop's host time from
             collecting a step to launching this one (commit, plan, pack, dispatch); the step in
             flight is collected only after it, so it ends no earlier than that:
             `cbjax.sim.timeline.Timeline.launch`. A tiny model's decode step on a CPU is
             over before the host is: its share of the wall clock is this host time, and a
             prefill in the next plan lengthens it. With nothing in flight, the first step and
             the first after an idle loop, the step itself starts after its own launch)
    held = held_prefill_s + held_prefill_token_s * tokens  for a plan with any prefill rows
             (`StepTime.held_s`: what the launch takes more with a step in flight; where the
             host and the device share a CPU core, a step call that finds the device idle runs
             the step in its place, so the launch holds its compute; one that queues it leaves
             that compute to share the core with the host's next work: the same sum)
    collect = collect_prefill_share  for a plan with any prefill rows (`StepTime.collect_share`: the
             step in flight is collected no earlier than this share of its own time after the
             plan's launch returns; where the host and the device share a core, the launch's host
             time holds back the step in flight, which still owes that share of its work after a
             prefill plan's long launch; a decode plan's launch stays inside the step's own fitted
             time)
    drain = min(time, drain_s)  (`drain_s`: the share of a step the pipelined loop collects
             with nothing launched behind it, as the last before an idle loop or a run's end: the
             device's own remainder, which the next launch's host time otherwise hides;
             `cbjax.sim.timeline.Timeline.land`)

The step terms are fitted on the grid's steps, which reach long contexts and large prefills;
the fixed costs (and, when asked, the cold terms) on the iterations the profile serves through
the real loop over them, since a step there costs what a run pays, not what the same step costs
run back to back (`cbjax.profile.served_fit.fit_served`). `token_s` is the work per token the step
really holds: the native matmul multiplies those and skips the bucket's padding, so the model's
matmuls grow with the tokens, not the bucket (XLA's matmuls compute the padding too: their cost
is the bucket's, and `token_s` fits near 0). The attention's work does not grow with the
bucket, so the `*_chunk_token_s` terms should fit near 0; they stay for kernels whose steps
touch every token of the bucket. A bucket the profile did not time
gets its intercept interpolated linearly in the bucket size.

Pure numpy: no jax import.
"""

from __future__ import annotations

import functools
import json
from itertools import islice
from pathlib import Path
from typing import Optional, Sequence

import numpy as np

from cbjax.config import CacheConfig, ExecutorConfig, ModelConfig, SchedulerConfig
from cbjax.core.plan import Schedule
from cbjax.core.timing import NO_CONTEXT, StepContext, StepTime
from cbjax.layout.shapes import ShapePlan, plan_shapes
from cbjax.layout.tiles import count_steps, group_pages, steps_of
from cbjax.sim.launch_terms import HELD_TERMS, LAUNCH_TERMS, held_cost, launch_cost

# The step terms of the fit besides the per-bucket intercepts `bucket_s`, and the swap terms.
STEP_TERMS = (
    "iter_s", "seq_s", "single_chunk_s", "block_chunk_s", "single_chunk_token_s", "block_chunk_token_s",
    "single_page_s", "block_page_s", "token_s",
)  # fmt: skip
SWAP_TERMS = ("swap_iter_s", "swap_page_s")
# The swap copies fitted one direction at a time: the host tier's stores (out) and loads (in).
SWAP_DIRECTION_TERMS = ("swap_out_iter_s", "swap_out_page_s", "swap_in_iter_s", "swap_in_page_s")
SERVE_TERMS = ("bucket_scale",)
# The cold terms: what the 1st .. 4th step after the last step of a larger bucket pays more.
COLD_TERMS = ("cold_s", "cold2_s", "cold3_s", "cold4_s")
# the least `ProfiledCost.drain_s` charges: a collect takes some time, and a step's drained end
# must lie past its begin (see there)
DRAIN_FLOOR_S = 1e-6
# absent from profiles made before the terms: charged 0
OPTIONAL_TERMS = dict.fromkeys(
    COLD_TERMS + ("token_s", "wake_token_s", "collect_prefill_share") + LAUNCH_TERMS + HELD_TERMS, 0.0
)
LOOP_TERMS = ("loop_s", "loop_seq_s", "wake_s", "wake_ramp_s")
# ModelConfig fields a profile must share with the run: they set the step's shapes and work.
ARCH_FIELDS = (
    "vocab_size", "d_model", "num_layers", "num_heads", "num_kv_heads", "head_dim", "ffn_dim",
    "max_model_len", "tie_embeddings", "dtype", "mlp", "attention_bias", "o_proj_bias", "mlp_bias",
)  # fmt: skip


def count_tiles(rows: Sequence[tuple[int, int, bool]], page_size: int, bucket: int, num_rows: int) -> tuple[int, int]:
    """(single, block) inner loop steps the XLA ragged attention runs for rows of
    (num_new_tokens, num_context_tokens, _) in a step of `bucket` tokens over `num_rows` slots,
    as `cbjax.layout.tiles.count_steps` counts them."""
    _, single, _, block = count_steps([(n, ctx) for n, ctx, _ in rows], page_size, bucket, num_rows)
    return single, block


def pages_read(rows: Sequence[tuple[int, int, bool]], page_size: int, bucket: int, num_rows: int) -> tuple[int, int]:
    """(single, block) KV pages the attention's groups really read (`cbjax.layout.tiles.group_pages`).
    Inner loop steps cost by the longest group of a chunk; these cost by the pages read (cache
    misses follow real pages)."""
    single, block = group_pages([(n, ctx) for n, ctx, _ in rows], page_size, bucket, num_rows)
    return sum(single), sum(block)


def steps_since_larger(recent: Sequence[int], bucket: int) -> int:
    """k (1 .. len(COLD_TERMS)) when the k-th step before this one, `recent[k - 1]` (the last step's
    bucket first), is the latest of a larger bucket than `bucket`; 0 if none of those is. The
    step pays COLD_TERMS[k - 1]."""
    for k, previous in enumerate(islice(recent, len(COLD_TERMS)), 1):
        if previous > bucket:
            return k
    return 0


def wake_cost(coefficients: dict, idle_s: float, tokens: int = 0) -> float:
    """What the first step after the loop idled `idle_s` seconds pays more, for a step of
    `tokens` tokens (`wake_s` and `wake_token_s`, reached after `wake_ramp_s` of idling)."""
    level = coefficients["wake_s"] + coefficients.get("wake_token_s", 0.0) * tokens
    return level * min(1.0, idle_s / max(coefficients["wake_ramp_s"], 1e-9))


def drain_share(drain_s: float, cost: float) -> float:
    """The share of a step of `cost` collected with nothing launched behind it: `drain_s`, never
    above the cost and never below DRAIN_FLOOR_S (`ProfiledCost.drain_s`)."""
    return min(cost, max(drain_s, DRAIN_FLOOR_S))


def cold_cost(coefficients: dict, since_larger: int) -> float:
    """What a step `since_larger` steps after the last larger bucket's pays (`steps_since_larger`)."""
    return coefficients.get(COLD_TERMS[since_larger - 1], 0.0) if since_larger else 0.0


def step_bucket(shapes: ShapePlan, tokens: int) -> int:
    """The token bucket of a step of `tokens` tokens. A padded static batch
    (`Schedule.padded_rows`) may hold more than the largest bucket: its own size extrapolates."""
    return shapes.bucket(max(tokens, 1)) if tokens <= shapes.token_buckets[-1] else tokens


def step_features(rows: Sequence[tuple[int, int, bool]], shapes: ShapePlan, native: bool = False) -> tuple[int, list[float]]:
    """(token bucket, the STEP_TERMS multipliers) of one step over `rows`, under the engine's shape
    plan. `native`: the engine's attention is `native`, whose decode pass (the single list) has no
    inner loop steps: its `single_chunk_s` term counts single groups (a cost per token) and its
    `single_chunk_token_s` term is 0; the pages each group reads stay in `single_page_s`."""
    tokens = sum(n for n, _, _ in rows)
    bucket = step_bucket(shapes, tokens)
    cost_rows = [(n, ctx) for n, ctx, _ in rows]
    single_groups, block_groups = group_pages(cost_rows, shapes.page_size, bucket, shapes.num_rows)
    _, single, _, block = steps_of(single_groups, block_groups, bucket)  # one grouping for both counts
    single_x, single_token_x = (float(len(single_groups)), 0.0) if native else (float(single), float(single * bucket))
    return bucket, [
        1.0, float(len(rows)), single_x, float(block), single_token_x, float(block * bucket),
        float(sum(single_groups)), float(sum(block_groups)), float(tokens),
    ]  # fmt: skip


def bucket_intercept(bucket_s: dict[int, float], bucket: int) -> float:
    """A bucket's fixed cost: timed, or linear between the nearest timed buckets (beyond the
    largest, along the last two; below the smallest, the smallest's)."""
    if bucket in bucket_s:
        return bucket_s[bucket]
    xs = sorted(bucket_s)
    if len(xs) >= 2 and bucket > xs[-1]:
        x0, x1 = xs[-2], xs[-1]
        return bucket_s[x1] + (bucket - x1) * (bucket_s[x1] - bucket_s[x0]) / (x1 - x0)
    return float(np.interp(bucket, xs, [bucket_s[x] for x in xs]))


def profile_key(model: ModelConfig, page_size: int, num_slots: int) -> dict:
    """What a profile must match: the model's architecture, the page size and the slot count,
    which set the step's shapes. Not the page pool: a step reads only the pages it gathers, so
    another `cache.num_pages` is accepted (though over a run a larger pool spreads the pages in
    use wider and served steps cost some more: the README's calibration section)."""
    key = {f"model.{f}": getattr(model, f) for f in ARCH_FIELDS}
    key["cache.page_size"] = page_size
    key["scheduler.max_num_seqs"] = num_slots
    return key


@functools.lru_cache(maxsize=4)
def _parsed(path: Path, mtime_ns: int, size: int) -> dict:
    """The parsed file at `path` as it was at (`mtime_ns`, `size`): a profile keeps every served
    step it was fitted on (tens of MB for a tiny model), and a calibration or a sweep builds the
    simulator from one profile many times."""
    return json.loads(path.read_text())


def model_coefficients(raw: dict) -> dict:
    """A profile's `coefficients` (as stored: bucket keys may be strings) as `ProfiledCost` reads
    them; a missing term is a KeyError, an empty `bucket_s` a ValueError."""
    required = [k for k in STEP_TERMS + SERVE_TERMS + SWAP_TERMS + LOOP_TERMS if k not in OPTIONAL_TERMS]
    coef = {k: float(raw[k]) for k in required}
    coef.update({k: float(raw.get(k, v)) for k, v in OPTIONAL_TERMS.items()})
    coef["bucket_s"] = {int(b): float(v) for b, v in raw["bucket_s"].items()}
    served = raw.get("served_bucket_s") or {}  # absent from earlier profiles
    coef["served_bucket_s"] = {int(b): float(v) for b, v in served.items()}
    coef.update({k: float(raw[k]) for k in SWAP_DIRECTION_TERMS if k in raw})
    if raw.get("drain_s") is not None:  # absent from earlier profiles: `ProfiledCost.drain_s`
        coef["drain_s"] = float(raw["drain_s"])
    if not coef["bucket_s"]:
        raise ValueError("coefficients.bucket_s is empty")
    return coef


def load_profile(path: str, model: ModelConfig, page_size: int, num_slots: int) -> dict:
    """Read and check `profile.json`; a missing, malformed or mismatched file is a one-line
    ValueError. The file is parsed once while it is unchanged: the returned dict's own
    `coefficients` are fresh, its other values shared between calls (read them, do not change them)."""
    p = Path(path).expanduser()
    if not p.is_file():
        raise ValueError(f"executor.profile: no profile at {p} (make one with `python -m cbjax.profile`)")
    try:
        stat = p.stat()
        profile = dict(_parsed(p.resolve(), stat.st_mtime_ns, stat.st_size))
        made_for = dict(profile["made_for"])
        coef = model_coefficients(profile["coefficients"])
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, ValueError) as err:
        raise ValueError(f"executor.profile: {p} is not a cbjax profile ({type(err).__name__}: {err})") from None
    for key, ours in profile_key(model, page_size, num_slots).items():
        if key not in made_for:  # a profile from before the key was matched: what it was made for is unknown
            raise ValueError(
                f"executor.profile: {p} does not record {key} (made by an earlier cbjax); "
                "profile again with `python -m cbjax.profile`"
            )
        theirs = made_for[key]
        if theirs != ours:
            hint = f"; it profiled model {profile['model']!r}" if key.startswith("model.") and profile.get("model") else ""
            raise ValueError(f"executor.profile: made for {key}={theirs}, this run has {ours} ({p}){hint}")
    profile["coefficients"] = coef
    return profile


class ProfiledCost:
    """Iteration time from a fitted profile (see the module docstring for the formula): a pure
    function of the plan and its `StepContext`.

    The CPU term set (`wake_s`, the cold terms) is what a CPU's threads and caches add to a
    step after an idle wait or after a larger step; a profile made on a CPU measures it, any
    other leaves it 0 and the model then reads no history."""

    name = "profiled"

    def __init__(self, coefficients: dict, shapes: ShapePlan, native: bool = False, prefix_caching: bool = False):
        self.coefficients = coefficients
        self.native = native  # the profile timed the `native` attention backend (see `step_features`)
        self.prefix_caching = prefix_caching  # the run's cache.prefix_caching (`launch_cached_seq_s`)
        self.swap_iter_s = coefficients["swap_iter_s"]
        self.swap_page_s = coefficients["swap_page_s"]
        # the host tier's stores and loads: (fixed, per page) seconds, the swap terms if unfitted
        out_iter, out_page, in_iter, in_page = SWAP_DIRECTION_TERMS
        self.store_terms = (coefficients.get(out_iter, self.swap_iter_s), coefficients.get(out_page, self.swap_page_s))
        self.load_terms = (coefficients.get(in_iter, self.swap_iter_s), coefficients.get(in_page, self.swap_page_s))
        self.loop_s = coefficients["loop_s"]
        self.loop_seq_s = coefficients["loop_seq_s"]
        self.shapes = shapes
        self.wake = coefficients.get("wake_s", 0.0) > 0 or coefficients.get("wake_token_s", 0.0) > 0
        # the batched tokens of the steps before this one the cold terms read
        self.history = len(COLD_TERMS) if any(coefficients.get(k, 0.0) for k in COLD_TERMS) else 0
        # the share of a step collected with nothing launched behind it; None: a profile made
        # before it, which charges such a step its whole cost
        self.drain = coefficients.get("drain_s")
        self.collect_prefill_share = coefficients.get("collect_prefill_share", 0.0)

    def __call__(self, plan: Schedule, ctx: StepContext = NO_CONTEXT) -> StepTime:
        coef = self.coefficients
        rows = plan.cost_rows()
        tokens = prefills = carried = 0
        for n, context, decode in rows:  # one walk: the wake's and launch terms, `rows_left`'s count
            tokens += n
            prefills += not decode
            carried += context > 0
        bucket, x = step_features(rows, self.shapes, self.native)
        device = predict(coef, bucket, x)
        if self.wake and ctx.idle_s > 0:
            device += wake_cost(coef, ctx.idle_s, tokens)
        if self.history:
            buckets = [step_bucket(self.shapes, n) for n in ctx.recent_tokens]
            device += cold_cost(coef, steps_since_larger(buckets, bucket))
        host = self.loop_s + self.loop_seq_s * plan.num_scheduled
        pages = plan.num_swapped_pages
        copy = self.swap_iter_s + self.swap_page_s * pages if pages else 0.0
        left = max(0, ctx.in_flight_rows - carried)
        launch = launch_cost(coef, len(rows), prefills, tokens, self.prefix_caching, left)
        load = prefetch = 0.0
        if plan.host_copies is not None:
            copies = plan.host_copies
            load = _copy_s(self.load_terms, copies.num_loaded)
            prefetch = _copy_s(self.load_terms, copies.num_prefetched)
            copy += _copy_s(self.store_terms, len(copies.store)) + load
        collect = self.collect_prefill_share if prefills else 0.0
        held = held_cost(coef, prefills, tokens)
        time = StepTime(device, host, copy, launch, None, load, prefetch, collect, held)
        if self.drain is None:
            return time
        return time._replace(drain_s=drain_share(self.drain, time.total_s))


def _copy_s(terms: tuple[float, float], num_pages: int) -> float:
    """A batched copy of `num_pages` pages under (fixed, per page) `terms`; 0 for no page."""
    return terms[0] + terms[1] * num_pages if num_pages else 0.0


def make_profiled_cost(
    model: ModelConfig, scheduler: SchedulerConfig, cache: CacheConfig, executor: ExecutorConfig
) -> ProfiledCost:
    if not executor.profile:
        raise ValueError("executor.profile: cost_model=profiled needs a profile.json path (executor.profile=PATH)")
    profile = load_profile(executor.profile, model, cache.page_size, scheduler.max_num_seqs)
    native = profile.get("attention") == "native"
    shapes = shapes_for(model, scheduler, cache, executor)
    return ProfiledCost(profile["coefficients"], shapes, native, cache.prefix_caching)


def fixed_cost(coefficients: dict, bucket: int) -> float:
    """A bucket's fixed cost in a served step: the profile's served intercept for it, or the
    grid's timing of its program scaled by `bucket_scale` (see the module docstring)."""
    served = coefficients.get("served_bucket_s") or {}
    if bucket in served:
        return served[bucket]
    return coefficients["bucket_scale"] * bucket_intercept(coefficients["bucket_s"], bucket)


def step_terms(coefficients: dict, features: Sequence[float]) -> float:
    """A step's cost beyond its bucket's fixed cost: the STEP_TERMS times their `features`."""
    return sum(coefficients[k] * v for k, v in zip(STEP_TERMS, features))


def predict(coefficients: dict, bucket: int, features: Sequence[float]) -> float:
    """A step's predicted time from its bucket and STEP_TERMS features (see the module docstring)."""
    return fixed_cost(coefficients, bucket) + step_terms(coefficients, features)


def shapes_for(
    model: ModelConfig, scheduler: SchedulerConfig, cache: CacheConfig, executor: Optional[ExecutorConfig]
) -> ShapePlan:
    """The engine's shape plan for a run's configs (as `JaxExecutor` builds it)."""
    buckets = executor.token_buckets if executor is not None else None
    return plan_shapes(
        scheduler.max_num_seqs, model.max_model_len, cache.page_size, scheduler.max_num_batched_tokens, buckets
    )
