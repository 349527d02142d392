"""The profiled cost model: tile counts against the real packer, the fit against hand-set costs,
profile loading and its errors, and deterministic simulator runs (no jax compile here)."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import numpy as np
import pytest

from conftest import make_plan
from cbjax.config import CacheConfig, ExecutorConfig, ModelConfig, RunConfig, SchedulerConfig, WorkloadConfig
from cbjax.core.plan import Schedule
from cbjax.profile.grid import GridPoint, build_schedule, profile_grid
from cbjax.profile.measure import fit_profile, measure_buckets, measure_steps, others_share
from cbjax.core.request import Request
from cbjax.runtime.batch import BatchPacker
from cbjax.layout.shapes import plan_shapes
from cbjax.layout.tiles import PAGES_BLOCK, PAGES_SINGLE
from cbjax.core.timing import StepContext
from cbjax.sim import make_cost_model
from cbjax.sim.timeline import Timeline
from cbjax.profile.fit import fit_costs, nnls
from cbjax.sim.profiled import (
    COLD_TERMS, STEP_TERMS, SWAP_TERMS, count_tiles, pages_read, profile_key, step_features, steps_since_larger,
)  # fmt: skip

MODEL = ModelConfig()  # tiny


def test_count_tiles_by_hand():
    # page_size 4, pages read 2 per single step and 4 per block step (cbjax.layout.tiles): a
    # decode at position 4 reads 2 pages (1 step); a 20-token prefill is one group ending at
    # position 19: 5 pages, 2 steps; a 2-token chunk after 6 cached tokens ends at position 7:
    # 2 pages, 1 step, beside a decode at position 3 (1 page, 1 step).
    assert count_tiles([(1, 4, True)], 4, 4, 2) == (1, 0)
    assert count_tiles([(20, 0, False)], 4, 64, 2) == (0, 2)
    assert count_tiles([(2, 6, False), (1, 3, True)], 4, 4, 2) == (1, 1)
    assert pages_read([(1, 4, True)], 4, 4, 2) == (2, 0)
    assert pages_read([(20, 0, False)], 4, 64, 2) == (0, 5)
    assert pages_read([(2, 6, False), (1, 3, True)], 4, 4, 2) == (1, 2)
    # over 4 slots the 4-token step lists each token as a group: positions 6 and 7 read 2 pages,
    # position 3 reads 1; one chunk, one step of 2 pages, and no block list
    assert count_tiles([(2, 6, False), (1, 3, True)], 4, 4, 4) == (1, 0)
    assert pages_read([(2, 6, False), (1, 3, True)], 4, 4, 4) == (5, 0)


def test_step_features_of_the_native_backend_count_groups_not_loop_steps_by_hand():
    # page_size 4 over 4 slots, bucket 4: three decodes at positions 20, 3 and 9 read 6, 1 and 3
    # pages. The XLA pass runs them as one chunk of 6 pages, 2 per step: 3 steps (x bucket 4 =
    # 12); the native pass has no steps: 3 groups, no token term. Pages read: 10 either way.
    shapes = plan_shapes(num_rows=4, max_model_len=64, page_size=4, max_num_batched_tokens=64)
    rows = [(1, 20, True), (1, 3, True), (1, 9, True)]
    assert PAGES_SINGLE == 2
    bucket, xla = step_features(rows, shapes)
    assert bucket == 4
    assert dict(zip(STEP_TERMS, xla)) == {
        "iter_s": 1.0, "seq_s": 3.0, "single_chunk_s": 3.0, "block_chunk_s": 0.0, "single_chunk_token_s": 12.0,
        "block_chunk_token_s": 0.0, "single_page_s": 10.0, "block_page_s": 0.0, "token_s": 3.0,
    }  # fmt: skip
    _, native = step_features(rows, shapes, native=True)
    assert dict(zip(STEP_TERMS, native)) == {**dict(zip(STEP_TERMS, xla)), "single_chunk_s": 3.0, "single_chunk_token_s": 0.0}
    # two decodes at position 20: 2 groups natively, still 3 XLA steps
    two = [(1, 20, True), (1, 20, True)]
    assert dict(zip(STEP_TERMS, step_features(two, shapes)[1]))["single_chunk_s"] == 3.0
    assert dict(zip(STEP_TERMS, step_features(two, shapes, native=True)[1]))["single_chunk_s"] == 2.0


def test_count_tiles_matches_the_packers_tile_lists():
    shapes = plan_shapes(num_rows=6, max_model_len=96, page_size=4, max_num_batched_tokens=256)
    rng = np.random.default_rng(3)
    seen = set()
    for _ in range(30):
        rows = []
        for _ in range(int(rng.integers(1, 7))):
            n = int(rng.choice([1, 1, int(rng.integers(2, 40))]))
            ctx = int(rng.integers(0 if n > 1 else 1, 96 - n))
            rows.append((n, ctx))
        plan = build_schedule(GridPoint("mixed", rows), shapes, num_pages=64, vocab_size=512)
        batch = BatchPacker(shapes, tiles=True).pack(plan)
        bucket = batch.tokens.shape[0]
        assert count_tiles(plan.cost_rows(), 4, bucket, shapes.num_rows) == packed_steps(batch), rows
        assert pages_read(plan.cost_rows(), 4, bucket, shapes.num_rows) == packed_pages(batch, 4), rows
        seen.add(bucket <= shapes.num_rows)
    assert seen == {True, False}  # steps with and without a block list


def packed_pages(batch, page_size: int) -> tuple[int, int]:
    """(single, block) KV pages a packed batch's groups read: each group in use reads its row's
    pages up to its last query token's position."""
    out = []
    num_tokens = batch.tokens.shape[0]
    for q_idx, *_ in batch.tiles:
        pages = 0
        for group in q_idx:
            real = group[group < num_tokens]
            if len(real):
                pages += int(batch.token_pos[real].max()) // page_size + 1
        out.append(pages)
    return tuple(out)


def packed_steps(batch) -> tuple[int, int]:
    """(single, block) inner loop steps of a packed batch: each chunk in use runs as many as
    its first group's pages need."""
    out = []
    for (_, _, chunk_pages, num), step in zip(batch.tiles, (PAGES_SINGLE, PAGES_BLOCK)):
        out.append(sum(-(-int(p) // step) for p in chunk_pages[: int(num)]))
    return tuple(out)


def test_nnls_matches_a_hand_solved_problem():
    # fit y = x1 + x2 t through (0, 2), (1, 1), (2, 1.5): least squares has slope -0.25, so the
    # constraint sets x2 = 0 and x1 = the mean, 1.5
    a = np.array([[1.0, 0.0], [1.0, 1.0], [1.0, 2.0]])
    x = nnls(a, np.array([2.0, 1.0, 1.5]))
    assert x[1] == 0.0 and x[0] == pytest.approx(1.5)
    assert nnls(a, a @ np.array([0.5, 2.0])) == pytest.approx([0.5, 2.0])


def test_fit_costs_on_relative_and_on_absolute_error_by_hand():
    # y = c x through (1, 1) and (10, 20). Relative: minimise (c - 1)^2 + (c/2 - 1)^2, c = 1.5/1.25
    # = 1.2. Absolute: c = (1*1 + 10*20) / (1 + 100) = 201/101 (the 20 s point dominates)
    assert fit_costs([[1.0], [10.0]], [1.0, 20.0]) == pytest.approx([1.2])
    assert fit_costs([[1.0], [10.0]], [1.0, 20.0], relative=False) == pytest.approx([201 / 101])


# Hand-set costs for the synthetic executor: a fixed cost per token bucket (not linear in its
# size: bucket 24 oddly slow), per iteration, per row, per inner loop step of single and block groups.
BUCKET_S = {4: 2.1e-3, 8: 2.2e-3, 16: 2.5e-3, 24: 9e-3, 32: 3e-3, 64: 4e-3, 128: 6e-3, 256: 1e-2, 512: 2e-2}
TRUE = {"iter_s": 4e-4, "seq_s": 5e-5, "single_chunk_s": 3e-4, "block_chunk_s": 2e-4,
        "single_chunk_token_s": 2e-6, "block_chunk_token_s": 1e-6, "single_page_s": 2e-5, "block_page_s": 3e-5}  # fmt: skip


class SyntheticExecutor:
    """Step time (`time_step`) set by hand over what the real packer builds, times 1 +- `noise` (0.5 %): a fixed
    cost per bucket, `fixed[bucket]` or `bucket_scale` x BUCKET_S, plus `coef` (TRUE), plus
    `cold[k - 1]` on the k-th step after the last step of a larger bucket; `run_empty` is a
    bucket's all-padding step (its BUCKET_S alone)."""

    def __init__(self, shapes, seed=0, bucket_scale=1.0, noise=0.005, fixed=None, cold=(0.0, 0.0, 0.0, 0.0)):
        self.packer = BatchPacker(shapes, tiles=True)
        self.rng = np.random.default_rng(seed)
        self.coef, self.bucket_scale, self.noise, self.fixed, self.cold = TRUE, bucket_scale, noise, fixed or {}, cold
        self.buckets = []  # every step's bucket so far

    def time_step(self, plan: Schedule) -> float:
        b = self.packer.pack(plan)
        single, block = packed_steps(b)
        single_pages, block_pages = packed_pages(b, 8)
        bucket = b.tokens.shape[0]
        c = self.coef
        t = (
            self.fixed.get(bucket, self.bucket_scale * BUCKET_S[bucket]) + c["iter_s"] + c["seq_s"] * b.num_rows_used
            + (c["single_chunk_s"] + c["single_chunk_token_s"] * bucket) * single
            + (c["block_chunk_s"] + c["block_chunk_token_s"] * bucket) * block
            + c["single_page_s"] * single_pages + c["block_page_s"] * block_pages
        )  # fmt: skip
        larger = [k for k in range(1, len(self.buckets) + 1) if self.buckets[-k] > bucket]
        if larger and larger[0] <= len(self.cold):
            t += self.cold[larger[0] - 1]
        self.buckets.append(bucket)
        return t * (1 + self.rng.uniform(-self.noise, self.noise))

    def run_empty(self, bucket: int) -> float:
        return BUCKET_S[bucket] * (1 + self.rng.uniform(-0.005, 0.005))


def test_fit_recovers_hand_set_coefficients_from_a_synthetic_executor():
    shapes = plan_shapes(num_rows=32, max_model_len=256, page_size=8, max_num_batched_tokens=512)
    assert shapes.token_buckets == tuple(BUCKET_S)
    points = profile_grid(shapes, 256, "full")
    synthetic = SyntheticExecutor(shapes)
    steps = measure_steps(synthetic.time_step, points, shapes, 2048, 512, repeats=3)
    bucket_s = measure_buckets(synthetic.run_empty, shapes.token_buckets, repeats=3)
    coef, residuals = fit_profile(steps, [], bucket_s)
    for key, value in TRUE.items():  # nothing served: the model is the grid's
        assert coef[key] == pytest.approx(value, rel=0.15), key
        assert residuals["grid_coefficients"][key] == coef[key]
    assert coef["bucket_scale"] == 1.0
    for bucket, value in BUCKET_S.items():
        assert coef["bucket_s"][str(bucket)] == pytest.approx(value, rel=0.05), bucket
    assert residuals["max_rel_error"] < 0.02 and residuals["num_points"] == len(points)


@pytest.mark.parametrize("fit_cold", [True, False])
def test_fit_recovers_hand_set_served_costs_over_the_grids_step_terms_and_the_loops(fit_cold):
    # The grid timed back to back by one synthetic executor (bucket costs BUCKET_S, step terms
    # TRUE); served iterations by another, with the same step terms and fixed costs of their own:
    # the decode buckets 4..32 each by hand (not one factor: 4, 8 and 24 run faster served, 16 and 32
    # slower), a bucket served only a few times (64) at 0.9 x its grid timing. With `fit_cold`,
    # the 1st to 4th step after the last step of a larger bucket pays 0.4, 0.2, 0.1, 0.05 ms
    # more; without (the profile's default), no step does and the cold terms stay 0. Iterations
    # after an idle loop (10x slower here) are left to the wake term; the loop's host time after
    # each iteration is 30 us + 2 us per request, exactly.
    shapes = plan_shapes(num_rows=32, max_model_len=256, page_size=8, max_num_batched_tokens=512)
    points = profile_grid(shapes, 256, "full")
    steps = measure_steps(SyntheticExecutor(shapes, noise=1e-4).time_step, points, shapes, 2048, 512, repeats=3)
    bucket_s = measure_buckets(SyntheticExecutor(shapes).run_empty, shapes.token_buckets, repeats=3)
    fixed = {4: 1.0e-3, 8: 1.2e-3, 16: 3.5e-3, 24: 6e-3, 32: 4.5e-3}
    cold = (4e-4, 2e-4, 1e-4, 5e-5) if fit_cold else (0.0, 0.0, 0.0, 0.0)
    decodes = sorted((p for p in points if p.kind == "decode"), key=lambda p: len(p.rows))
    mixed = [p for p in points if p.kind == "mixed" and shapes.bucket(sum(n for n, _ in p.rows)) == 64][:1]
    assert len(mixed) == 1
    rng = np.random.default_rng(2)
    order = [d for _ in range(10) for d in (decodes[i] for i in rng.permutation(len(decodes)))] + decodes[::-1]
    for i in (7, 60, 111):  # a few 64-token steps among the decodes, each followed by small steps
        order.insert(i, mixed[0])
    served_run = SyntheticExecutor(shapes, seed=1, noise=1e-4, fixed={**fixed, 64: 0.9 * BUCKET_S[64]}, cold=cold)
    served, recent = [], []
    for point in order:
        plan = build_schedule(point, shapes, 2048, 512)
        bucket, features = step_features(plan.cost_rows(), shapes)
        served.append({"kind": point.kind, "source": "served", "bucket": bucket, "features": features, "idle": False,
                       "measured_s": served_run.time_step(plan),
                       "since_larger": steps_since_larger(recent, bucket)})  # fmt: skip
        recent.insert(0, bucket)
    since = [s["since_larger"] for s in served]
    assert all(since.count(k) >= 3 for k in (1, 2, 3, 4))  # every cold term is exercised
    woke = [{**s, "measured_s": 10 * s["measured_s"], "idle": True} for s in served[:5]]
    gaps = [(n, 30e-6 + 2e-6 * n) for n in (1, 4, 9, 32, 17)]
    wake = {"wake_s": 1e-3, "wake_ramp_s": 5e-3}
    coef, residuals = fit_profile(steps, [], bucket_s, served + woke, gaps, wake, fit_cold=fit_cold)
    assert set(coef["served_bucket_s"]) == {"4", "8", "16", "24", "32"}  # 64 was served 3 times: too few
    for bucket, value in fixed.items():
        assert coef["served_bucket_s"][str(bucket)] == pytest.approx(value, rel=0.02), bucket
    assert coef["bucket_scale"] == pytest.approx(0.9, rel=0.05)
    assert [coef[k] for k in COLD_TERMS] == pytest.approx(cold, rel=0.1, abs=5e-6)
    if not fit_cold:
        assert all(coef[k] == 0.0 for k in COLD_TERMS)
    for key, value in TRUE.items():  # the step terms are the grid's
        assert coef[key] == residuals["grid_coefficients"][key] == pytest.approx(value, rel=0.15), key
    assert coef["loop_s"] == pytest.approx(30e-6) and coef["loop_seq_s"] == pytest.approx(2e-6)
    assert (coef["wake_s"], coef["wake_ramp_s"]) == (1e-3, 5e-3)
    served_fit = residuals["served"]
    assert served_fit["num_points"] == len(served) and served_fit["median_rel_error"] < 0.01
    assert abs(served_fit["total_error"]) < 0.005
    measured = sum(s["measured_s"] for s in served) + sum(g for _, g in gaps)
    grid_model = sum(s["grid_model_s"] for s in served) + sum(g for _, g in gaps)
    assert served_fit["grid_model_total_error"] == pytest.approx(grid_model / measured - 1)
    # the grid model alone misses them step by step (the served buckets' costs are not the grid's)
    assert np.median([abs(s["grid_model_s"] / s["measured_s"] - 1) for s in served]) > 0.05


def write_profile(path, coefficients=None, model=MODEL, page_size=16, num_slots=32, num_pages=4096, attention="ragged"):
    coef = coefficients or {**TRUE, "bucket_s": {"4": 1e-3, "16": 2e-3, "64": 4e-3}, "bucket_scale": 1.1, "swap_iter_s": 1e-3,
                            "swap_page_s": 1e-4, "loop_s": 2e-4, "loop_seq_s": 1e-5, "wake_s": 1e-3, "wake_ramp_s": 5e-3}  # fmt: skip
    path.write_text(json.dumps({
        "made_for": profile_key(model, page_size, num_slots), "num_pages": num_pages, "coefficients": coef,
        "attention": attention,
    }))  # fmt: skip
    return str(path)


def configs(profile, **sched):
    return dict(
        scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, **sched),
        cache=CacheConfig(page_size=4, num_pages=4096, prefix_caching=False),  # its launch term: one test's
        executor=ExecutorConfig(cost_model="profiled", profile=profile, token_buckets=[4, 16, 64]),
    )


def only_bucket_costs(bucket_s: dict, **terms) -> dict:
    """Profile coefficients charging the bucket costs alone (bucket_scale 1, wake ramp 1 s), plus `terms`."""
    zero = dict.fromkeys(STEP_TERMS + SWAP_TERMS + ("loop_s", "loop_seq_s", "wake_s"), 0.0)
    return {**zero, "bucket_s": bucket_s, "bucket_scale": 1.0, "wake_ramp_s": 1.0, **terms}


def decode_and_prefill() -> tuple[Request, Request]:
    """A decode at position 4 (1 token) and a fresh 40-token prefill."""
    d = Request("d", 0.0, 5)
    d.num_computed, d.num_new_tokens = 4, 1
    p = Request("p", 0.0, 40)
    p.num_computed, p.num_new_tokens = 0, 40
    return d, p


def test_profiled_cost_by_hand(tmp_path):
    coef = {"bucket_s": {"4": 1.0, "64": 7.0}, "iter_s": 0.5, "seq_s": 0.001, "single_chunk_s": 10.0, "block_chunk_s": 100.0,
            "single_chunk_token_s": 0.0, "block_chunk_token_s": 1e-5, "single_page_s": 0.0, "block_page_s": 0.0, "bucket_scale": 2.0,
            "swap_iter_s": 1000.0, "swap_page_s": 10000.0, "loop_s": 0.25, "loop_seq_s": 0.125,
            "wake_s": 0.0, "wake_ramp_s": 1.0}  # fmt: skip
    path = write_profile(tmp_path / "p.json", coef, page_size=4, num_slots=4)
    cost = make_cost_model("profiled", MODEL, None, **configs(path))
    d = Request("d", 0.0, 5)
    d.num_computed, d.num_new_tokens = 4, 1
    p = Request("p", 0.0, 20)
    p.num_computed, p.num_new_tokens = 0, 20
    plan = make_plan(num_slots=4, decodes=[d], prefills=[p], page_size=4, swap_in=[(d, [7, 8])])
    # 21 tokens -> bucket 64; 2 rows; the decode at position 4 reads 2 pages (1 single step), the
    # 20-token prefill 5 pages (2 block steps, 64 bucket tokens each); 2 pages swapped; the
    # bucket's cost doubled (bucket_scale), the loop 0.25 + 0.125 per request
    assert cost(plan).total_s == pytest.approx(0.5 + 2 * 7.0 + 0.5 + 0.002 + 10.0 + 2 * (100.0 + 64e-5) + 1000.0 + 20000.0)
    assert cost(make_plan(num_slots=4, decodes=[d], page_size=4)).total_s == pytest.approx(0.375 + 2 * 1.0 + 0.5 + 0.001 + 10.0)
    # a profile of the native backend charges single_chunk_s per decode group: two decodes at
    # position 4 are 2 groups (the XLA pass runs them as 1 step of 2 pages)
    native = make_cost_model("profiled", MODEL, None, **configs(write_profile(tmp_path / "n.json", coef, page_size=4,
                                                                               num_slots=4, attention="native")))  # fmt: skip
    e = Request("e", 0.0, 5)
    e.num_computed, e.num_new_tokens = 4, 1
    two = make_plan(num_slots=4, decodes=[d, e], page_size=4)
    assert cost(two).total_s == pytest.approx(0.25 + 2 * 0.125 + 2 * 1.0 + 0.5 + 0.002 + 10.0)
    assert native(two).total_s == pytest.approx(0.25 + 2 * 0.125 + 2 * 1.0 + 0.5 + 0.002 + 2 * 10.0)
    # bucket 16 was not timed: between 4 (1.0) and 64 (7.0), linearly: 1.0 + 12/60 * 6.0
    p.num_new_tokens = 12
    assert cost(make_plan(num_slots=4, prefills=[p], page_size=4)).total_s == pytest.approx(
        0.375 + 2 * 2.2 + 0.5 + 0.001 + 100.0 + 16e-5
    )


def test_the_first_step_after_an_idle_loop_pays_the_wake_cost_by_hand(tmp_path):
    coef = only_bucket_costs({"4": 1.0}, wake_s=0.5, wake_ramp_s=4.0)
    path = write_profile(tmp_path / "p.json", coef, page_size=4, num_slots=4)
    cost = make_cost_model("profiled", MODEL, None, **configs(path))
    d = Request("d", 0.0, 5)
    d.num_computed, d.num_new_tokens = 4, 1
    plan = make_plan(num_slots=4, decodes=[d], page_size=4)
    # each step costs 1.0 (bucket 4); after a 1 s idle a quarter of the ramp (0.125); after 10 s
    # past the ramp (the whole 0.5)
    assert [cost(plan, StepContext(idle_s=idle)).total_s for idle in (0.0, 1.0, 10.0)] == pytest.approx([1.0, 1.125, 1.5])
    # the timeline knows the idle: the first step has no step before it; the second starts where
    # the first ended (busy); the third 1 s after the second ended; the fourth 10 s after
    timeline = Timeline(cost)
    assert [timeline.run(plan, start)[0] for start in (3.0, 4.0, 6.0, 17.125)] == pytest.approx([1.0, 1.0, 1.125, 1.5])


def test_steps_since_larger_by_hand():
    assert steps_since_larger([], 4) == 0  # the first step
    assert steps_since_larger([4, 4], 4) == 0  # same bucket: warm
    assert steps_since_larger([64, 4], 4) == 1
    assert steps_since_larger([4, 16, 64], 4) == 2  # the latest larger one counts
    assert steps_since_larger([16, 16, 16, 4], 16) == 0
    assert steps_since_larger([4, 4, 4, 64], 4) == 4 and steps_since_larger([4, 4, 4, 4, 64], 4) == 0


def test_steps_after_a_larger_buckets_pay_the_cold_costs_by_hand(tmp_path):
    coef = only_bucket_costs({"4": 1.0, "64": 7.0}, cold_s=0.25, cold2_s=0.125, cold3_s=0.0625, cold4_s=0.03125)
    path = write_profile(tmp_path / "p.json", coef, page_size=4, num_slots=4)
    cost = make_cost_model("profiled", MODEL, None, **configs(path))
    assert cost.history == 4  # the cold terms read the 4 steps before
    d, p = decode_and_prefill()
    small = make_plan(num_slots=4, decodes=[d], page_size=4)
    big = make_plan(num_slots=4, decodes=[d], prefills=[p], page_size=4)
    # the context's earlier steps (latest first, by their batched tokens): 41 tokens is bucket 64
    assert cost(small, StepContext(recent_tokens=(1, 41))).total_s == pytest.approx(1.125)
    assert cost(small, StepContext(recent_tokens=(1, 1, 1, 1, 41))).total_s == pytest.approx(1.0)
    # on a timeline: decode (bucket 4: 1.0), again (warm), decode + prefill (bucket 64: 7.0, a
    # larger one: warm), then decodes 1, 2, 3, 4 and 5 steps after it (+ 0.25, 0.125, 0.0625,
    # 0.03125, then warm)
    timeline, t, costs = Timeline(cost), 0.0, []
    for plan in [small, small, big] + [small] * 5:
        duration, t = timeline.run(plan, t)
        costs.append(duration)
    assert costs == pytest.approx([1.0, 1.0, 7.0, 1.25, 1.125, 1.0625, 1.03125, 1.0])
    for k in ("cold_s", "cold2_s", "cold3_s", "cold4_s"):  # a profile made before the terms charges nothing for them
        del coef[k]
    old = make_cost_model(
        "profiled", MODEL, None, **configs(write_profile(tmp_path / "old.json", coef, page_size=4, num_slots=4))
    )
    assert old.history == 0
    assert old(big).total_s == pytest.approx(7.0) and old(small, StepContext(recent_tokens=(41,))).total_s == pytest.approx(1.0)


def test_each_token_a_step_holds_pays_token_s_by_hand(tmp_path):
    # the native matmul's work follows the tokens, not the bucket: a decode (1 token, bucket 4)
    # costs 1.0 + 0.5; with a 40-token prefill (41 tokens, bucket 64) 7.0 + 41 x 0.5
    coef = only_bucket_costs({"4": 1.0, "64": 7.0}, token_s=0.5)
    cost = make_cost_model("profiled", MODEL, None, **configs(write_profile(tmp_path / "p.json", coef, page_size=4,
                                                                             num_slots=4)))  # fmt: skip
    d, p = decode_and_prefill()
    assert cost(make_plan(num_slots=4, decodes=[d], page_size=4)).total_s == pytest.approx(1.5)
    assert cost(make_plan(num_slots=4, decodes=[d], prefills=[p], page_size=4)).total_s == pytest.approx(27.5)
    del coef["token_s"]  # a profile made before the term charges nothing for it
    old = make_cost_model(
        "profiled", MODEL, None, **configs(write_profile(tmp_path / "old.json", coef, page_size=4, num_slots=4))
    )
    assert old(make_plan(num_slots=4, decodes=[d], prefills=[p], page_size=4)).total_s == pytest.approx(7.0)


def test_a_served_buckets_own_fixed_cost_replaces_the_scaled_grid_timing_by_hand(tmp_path):
    # bucket 4 has a served fixed cost of its own (1.5, not scaled); bucket 64 is the grid's 7.0 x 2
    coef = {**only_bucket_costs({"4": 1.0, "64": 7.0}), "bucket_scale": 2.0, "served_bucket_s": {"4": 1.5}}
    cost = make_cost_model("profiled", MODEL, None, **configs(write_profile(tmp_path / "p.json", coef, page_size=4,
                                                                             num_slots=4)))  # fmt: skip
    d, p = decode_and_prefill()
    assert cost(make_plan(num_slots=4, decodes=[d], page_size=4)).total_s == pytest.approx(1.5)
    assert cost(make_plan(num_slots=4, decodes=[d], prefills=[p], page_size=4)).total_s == pytest.approx(14.0)


def test_a_profile_for_another_model_page_size_or_slot_count_is_refused(tmp_path):
    big = dataclasses.replace(MODEL, d_model=256)
    cases = [
        (write_profile(tmp_path / "a.json", model=big, page_size=4, num_slots=4), "made for model.d_model=256, this run has 64"),
        (write_profile(tmp_path / "b.json", page_size=8, num_slots=4), "made for cache.page_size=8, this run has 4"),
        (write_profile(tmp_path / "c.json", page_size=4, num_slots=2), "made for scheduler.max_num_seqs=2, this run has 4"),
    ]  # fmt: skip
    for path, message in cases:
        with pytest.raises(ValueError, match=f"executor.profile: {message}"):
            make_cost_model("profiled", MODEL, None, **configs(path))
    named = json.loads(Path(cases[0][0]).read_text()) | {"model": "big"}  # the profile says which model it timed
    Path(cases[0][0]).write_text(json.dumps(named))
    with pytest.raises(ValueError, match=r"made for model.d_model=256, this run has 64 \(.*\); it profiled model 'big'$"):
        make_cost_model("profiled", MODEL, None, **configs(cases[0][0]))


def test_a_profile_that_predates_a_matched_field_is_refused_naming_it(tmp_path):
    # an earlier profile format recorded no model.mlp_bias: refused as such, not as "made for None"
    path = write_profile(tmp_path / "old.json", page_size=4, num_slots=4)
    old = json.loads(Path(path).read_text())
    del old["made_for"]["model.mlp_bias"]
    Path(path).write_text(json.dumps(old))
    with pytest.raises(ValueError) as err:
        make_cost_model("profiled", MODEL, None, **configs(path))
    assert str(err.value) == (
        f"executor.profile: {path} does not record model.mlp_bias (made by an earlier cbjax); "
        "profile again with `python -m cbjax.profile`"
    )


def test_a_profile_made_with_another_page_pool_is_accepted(tmp_path):
    # the step reads only the pages it gathers: a profile made at 512 pages serves a run with 4096
    path = write_profile(tmp_path / "p.json", page_size=4, num_slots=4, num_pages=512)
    cost = make_cost_model("profiled", MODEL, None, **configs(path))
    assert cost.shapes.token_buckets == (4, 16, 64)


def test_a_missing_or_malformed_profile_is_one_clear_line(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    partial = tmp_path / "partial.json"
    partial.write_text(json.dumps({"made_for": {}, "coefficients": {"iter_s": 1.0}}))
    for path, message in [(tmp_path / "none.json", "no profile at"), (bad, "is not a cbjax profile"),
                          (partial, "is not a cbjax profile")]:  # fmt: skip
        with pytest.raises(ValueError, match=f"executor.profile: .*{message}") as err:
            make_cost_model("profiled", MODEL, None, **configs(str(path)))
        assert "\n" not in str(err.value)
    with pytest.raises(ValueError, match="executor.profile"):
        ExecutorConfig(cost_model="profiled")


def test_a_profile_rewritten_in_place_is_read_again(tmp_path):
    # the parsed file is kept while it is unchanged (`_parsed`); a new profile at the same path is
    # read again, and each load's coefficients are its own
    coef = {**TRUE, "bucket_s": {"4": 1e-3, "16": 2e-3, "64": 4e-3}, "bucket_scale": 1.1, "swap_iter_s": 1e-3,
            "swap_page_s": 1e-4, "loop_s": 2e-4, "loop_seq_s": 1e-5, "wake_s": 1e-3, "wake_ramp_s": 5e-3}  # fmt: skip
    path = write_profile(tmp_path / "p.json", coefficients=coef, page_size=4, num_slots=4)
    first = make_cost_model("profiled", MODEL, None, **configs(path))
    again = make_cost_model("profiled", MODEL, None, **configs(path))
    assert first.loop_s == again.loop_s == 2e-4 and first.coefficients is not again.coefficients
    first.coefficients["loop_s"] = 1.0
    assert make_cost_model("profiled", MODEL, None, **configs(path)).loop_s == 2e-4
    write_profile(tmp_path / "p.json", coefficients={**coef, "loop_s": 0.00031}, page_size=4, num_slots=4)
    os.utime(path, ns=(1, 1))  # another mtime, whatever the file system's clock resolution
    assert make_cost_model("profiled", MODEL, None, **configs(path)).loop_s == 0.00031


def test_profiled_simulator_runs_are_deterministic(tmp_path):
    from cbjax.app.run import run_single

    path = write_profile(tmp_path / "p.json", page_size=4, num_slots=4)
    workload = WorkloadConfig(num_requests=30, arrival="poisson", rate=200.0)
    cfg = RunConfig(**configs(path, chunked_prefill=True), workload=workload, progress=False)
    first = run_single(cfg, tmp_path / "a", verbose=False)
    second = run_single(cfg, tmp_path / "b", verbose=False)
    wall = {"wall_s", "scheduler_host_s"}  # this process's own timings, not the simulation's
    assert {k: v for k, v in first.items() if k not in wall} == {k: v for k, v in second.items() if k not in wall}
    assert first["num_finished"] == 30 and first["cost_model"] == "profiled"
    assert (tmp_path / "a" / "requests.jsonl").read_text() == (tmp_path / "b" / "requests.jsonl").read_text()


def test_other_processes_cpu_share_by_hand():
    # 2 cores for 10 s: the machine was busy 14 CPU s, 9 of them ours: others took 5 of 20
    assert others_share(14.0, 9.0, 10.0, 2) == pytest.approx(0.25)
    assert others_share(9.0, 9.5, 10.0, 2) == 0.0  # clock ticks round below our own time: none
    assert others_share(30.0, 0.0, 10.0, 2) == 1.0 and others_share(1.0, 0.0, 0.0, 2) == 0.0


def _pipelined_recorder(rows: list) -> tuple:
    """(a TimedExecutor over a pipelined engine that ran no step, its shape plan), its per-step
    record set to `rows` (two scheduled requests each, no idle loop); the clock is the test's."""
    from cbjax.profile.serving import TimedExecutor

    class Inner:
        pipelined = True
        reads_token_ids = False

    timed = TimedExecutor(Inner())
    n = len(rows)
    timed.rows, timed.num_scheduled, timed.idle, timed.idle_s = rows, [2] * n, [False] * n, [0.0] * n
    return timed, plan_shapes(4, 64, 16, 64, token_buckets=[4, 16, 64])


def test_served_iterations_of_a_pipelined_engine_are_their_share_of_the_wall_clock_by_hand():
    # One step at a time: an iteration is its execute, the loop's gap after it counted apart.
    # Pipelined: step t+1 launches before step t ends, so an iteration runs from its launch or
    # the previous end, whichever is later, to its end, and no gaps are left to fit.
    from cbjax.profile.serving import served_points

    timed, shapes = _pipelined_recorder([[(1, 10, True)] * 2] * 3)
    timed.rows_at = timed.start = [0.0, 1.0, 4.0]
    timed.end = [2.0, 3.5, 5.0]
    steps, gaps = served_points("run", timed, shapes)
    assert [s["measured_s"] for s in steps] == [2.0, 1.5, 1.0] and gaps == []
    timed.pipelined = False
    steps, gaps = served_points("run", timed, shapes)
    assert [s["measured_s"] for s in steps] == [2.0, 2.5, 1.0] and gaps == [(2, -1.0), (2, 0.5)]


def test_a_pipelined_step_records_the_loops_host_time_before_its_collect_by_hand():
    # Four steps; step 3 holds a prefill row (5 tokens) beside a decode. Step 2 was launched at
    # 1.0 while step 1 ran (collected at 2.0), and step 3 at 2.5 while step 2 ran: step 2's share
    # starts at 2.0, the loop's host time before its collect is step 3's launch returning (3.0)
    # less 2.0 = 1.0, and the collect then waited 3.5 - 3.0 = 0.5. Step 1 was launched with
    # nothing in flight, and step 4 (at 6.0) after step 3's collect (5.0): neither records one.
    from cbjax.profile.served_fit import censored
    from cbjax.profile.serving import served_points

    decode, mixed = [(1, 10, True)] * 2, [(1, 10, True), (5, 0, False)]
    timed, shapes = _pipelined_recorder([decode, decode, mixed, decode])
    timed.rows_at = timed.start = [0.0, 1.0, 2.5, 6.0]
    timed.launched = [0.2, 1.3, 3.0, 6.1]
    timed.end = [2.0, 3.5, 5.0, 7.0]
    # arrivals handed to the scheduler: one before any launch, two after step 2's launch
    # returned (1.3) and before step 3's plan was handed over (2.5), one after that
    timed.arrived = [0.0, 1.5, 2.5, 2.6]
    timed.dispatch = [1e-4, 2e-4, 3e-4, None]  # each launch's step call (None: not the engine's handle)
    steps, _ = served_points("run", timed, shapes)
    assert [s["measured_s"] for s in steps] == [2.0, 1.5, 1.5, 1.0]
    assert [s.get("host_s") for s in steps] == [None, 1.0, None, None]
    assert steps[1]["arrivals"] == 2
    assert steps[1]["next_dispatch_s"] == 3e-4  # step 3's launch
    step = steps[1]
    assert (step["next_rows"], step["next_prefill_rows"], step["next_tokens"], step["collect_wait_s"]) == (2, 1, 6, 0.5)
    assert step["left"] == 1  # of step 2's two decodes, step 3 carries one on beside a new prefill
    assert not censored(step) and censored({**step, "collect_wait_s": 1e-6}) and not censored(steps[0])
    # launched with nothing in flight: step 1 (the first) and step 4 (after step 3's collect);
    # collected with nothing launched behind it: step 3 (step 4 came after its end) and step 4 (the last)
    assert [s["alone"] for s in steps] == [True, False, False, True]
    assert [s["uncovered"] for s in steps] == [False, False, True, True]


def test_a_step_planned_while_the_previous_runs_pays_no_wake_by_hand(tmp_path):
    # wake_s 0.5 over a 1 s ramp; each decode costs 1.0. Pipelined, step 2 is planned at 0 (while
    # step 1 runs, [0, 1]) and runs [1, 2]; step 3 is planned at 1 (step 1's collect) and runs
    # [2, 3]: neither waited for an arrival, so neither pays the wake. Step 4, planned at 3.5
    # after the loop collected step 3 (at 3) and idled 0.5 s, pays 0.5 x min(1, 0.5 / 1) = 0.25.
    coef = only_bucket_costs({"4": 1.0, "64": 7.0}, wake_s=0.5)
    cost = make_cost_model("profiled", MODEL, None, **configs(write_profile(tmp_path / "p.json", coef, page_size=4,
                                                                             num_slots=4)))  # fmt: skip
    d, _ = decode_and_prefill()
    plan = make_plan(num_slots=4, decodes=[d], page_size=4)
    timeline = Timeline(cost)
    one = timeline.launch(plan, 0.0)
    two = timeline.launch(plan, 0.0)
    assert timeline.land(one, covered=True) == (0.0, 1.0)
    three = timeline.launch(plan, 1.0)
    assert timeline.land(two, covered=True) == (1.0, 2.0)
    assert timeline.land(three, covered=False) == (2.0, 3.0)
    four = timeline.launch(plan, 3.5)
    assert [s.time.total_s for s in (one, two, three, four)] == pytest.approx([1.0, 1.0, 1.0, 1.25])
    assert (four.begin, four.end) == pytest.approx((3.5, 4.75))


def test_the_launch_terms_by_hand_and_a_long_launch_is_no_idle_loop(tmp_path):
    # launch_iter_s 0.1, 0.01 a row, 0.5 for a plan with a prefill and 0.2 a prefill row, 0.001
    # a token: a decode alone (1 row, 1 token) 0.111; the decode and a 40-token prefill (2 rows,
    # 41 tokens) 0.1 + 0.02 + 0.5 + 0.2 + 0.041 = 0.861
    launch = {"launch_iter_s": 0.1, "launch_seq_s": 0.01, "launch_prefill_s": 0.5, "launch_prefill_seq_s": 0.2,
              "launch_token_s": 0.001}  # fmt: skip
    coef = only_bucket_costs({"4": 1.0, "64": 7.0}, wake_s=0.5, **launch)
    cost = make_cost_model("profiled", MODEL, None, **configs(write_profile(tmp_path / "p.json", coef, page_size=4,
                                                                             num_slots=4)))  # fmt: skip
    d, p = decode_and_prefill()
    decode = make_plan(num_slots=4, decodes=[d], page_size=4)
    mixed = make_plan(num_slots=4, decodes=[d], prefills=[p], page_size=4)
    assert (cost(decode).launch_s, cost(mixed).launch_s) == pytest.approx((0.111, 0.861))
    # with the prefix cache on, 0.03 a row more (launch_cached_seq_s): 0.141 and 0.921; off, none
    coef = only_bucket_costs({"4": 1.0, "64": 7.0}, wake_s=0.5, launch_cached_seq_s=0.03, **launch)
    cfgs = configs(write_profile(tmp_path / "c.json", coef, page_size=4, num_slots=4))
    cached = make_cost_model("profiled", MODEL, None, **{**cfgs, "cache": CacheConfig(page_size=4, num_pages=4096,
                                                                                       prefix_caching=True)})  # fmt: skip
    assert (cached(decode).launch_s, cached(mixed).launch_s) == pytest.approx((0.141, 0.921))
    uncached = make_cost_model("profiled", MODEL, None, **cfgs)
    assert (uncached(decode).launch_s, uncached(mixed).launch_s) == pytest.approx((0.111, 0.861))
    # 0.05 a request the step in flight held and the plan does not carry on (launch_left_s):
    # after a step of two decodes, one of them beside the prefill, whose other decode left:
    # 0.861 + 0.05 = 0.911. With nothing in flight: 0.861.
    coef = only_bucket_costs({"4": 1.0, "64": 7.0}, wake_s=0.5, launch_left_s=0.05, **launch)
    left = make_cost_model("profiled", MODEL, None, **configs(write_profile(tmp_path / "l.json", coef, page_size=4,
                                                                             num_slots=4)))  # fmt: skip
    assert left(mixed, StepContext(in_flight_rows=2)).launch_s == pytest.approx(0.911)
    assert left(mixed).launch_s == pytest.approx(0.861)
    # Pipelined, launch 4.0 for a prefill: step 1 (a decode, [0, 1]); step 2 (a prefill, bucket
    # 64: 7.0) planned at 0 while step 1 runs, which the launch holds until 4.0: step 2 runs
    # [4, 11]; step 3 (a decode), planned at 4.0 (step 1's collect), runs [11, 12]; step 4, planned
    # at 11.0 (step 2's collect) while step 3 runs, is no idle loop: no wake (a clock that left
    # the launch out would put step 3's end at 9 and charge step 4 a 2 s idle's wake, 0.5).
    coef = only_bucket_costs({"4": 1.0, "64": 7.0}, wake_s=0.5, launch_prefill_s=4.0)
    cost = make_cost_model("profiled", MODEL, None, **configs(write_profile(tmp_path / "q.json", coef, page_size=4,
                                                                             num_slots=4)))  # fmt: skip
    prefill = make_plan(num_slots=4, prefills=[p], page_size=4)
    timeline = Timeline(cost)
    one = timeline.launch(decode, 0.0)
    two = timeline.launch(prefill, 0.0)
    assert timeline.land(one, covered=True) == (0.0, 4.0)
    three = timeline.launch(decode, 4.0)
    assert timeline.land(two, covered=True) == (4.0, 11.0)
    four = timeline.launch(decode, 11.0)
    assert timeline.land(three, covered=True) == (11.0, 12.0)
    assert [s.time.total_s for s in (one, two, three, four)] == pytest.approx([1.0, 7.0, 1.0, 1.0])


def test_a_prefill_plans_launch_collects_the_step_in_flight_a_share_of_its_time_after_it_by_hand(tmp_path):
    # launch_prefill_s 4.0 and collect_prefill_share 0.25; a decode costs 1.0 (bucket 4), a
    # prefill 7.0 (bucket 64). Decode 1 runs from 0; a prefill planned at 0 while it runs is
    # launched at 4.0, and the decode is collected 0.25 x 1.0 later: [0, 4.25]; the prefill runs
    # [4.25, 11.25]. A second prefill planned at 4.25 is launched at 8.25, and the prefill in
    # flight could be collected by 8.25 + 0.25 x 7.0 = 10.0, inside its time: it keeps its end.
    # Only a plan with prefill rows carries the term.
    coef = only_bucket_costs({"4": 1.0, "64": 7.0}, launch_prefill_s=4.0, collect_prefill_share=0.25)
    cost = make_cost_model("profiled", MODEL, None, **configs(write_profile(tmp_path / "c.json", coef, page_size=4,
                                                                             num_slots=4)))  # fmt: skip
    d, p = decode_and_prefill()
    decode = make_plan(num_slots=4, decodes=[d], page_size=4)
    prefill = make_plan(num_slots=4, prefills=[p], page_size=4)
    assert (cost(decode).collect_share, cost(prefill).collect_share) == (0.0, 0.25)
    timeline = Timeline(cost)
    one = timeline.launch(decode, 0.0)
    two = timeline.launch(prefill, 0.0)
    assert timeline.land(one, covered=True) == pytest.approx((0.0, 4.25))
    three = timeline.launch(prefill, 4.25)
    assert timeline.land(two, covered=True) == pytest.approx((4.25, 11.25))
    assert (three.begin, three.end) == pytest.approx((11.25, 18.25))
    # a profile without the term collects the decode as the launch returns
    coef.pop("collect_prefill_share")
    cost = make_cost_model("profiled", MODEL, None, **configs(write_profile(tmp_path / "n.json", coef, page_size=4,
                                                                             num_slots=4)))  # fmt: skip
    timeline = Timeline(cost)
    one = timeline.launch(decode, 0.0)
    timeline.launch(prefill, 0.0)
    assert timeline.land(one, covered=True) == pytest.approx((0.0, 4.0))


def test_a_prefill_plans_launch_behind_a_step_in_flight_takes_the_held_terms_by_hand(tmp_path):
    # launch_prefill_s 4.0, held_prefill_s 4.0 and held_prefill_token_s 0.025: the 40-token
    # prefill plan's held_s is 4.0 + 0.025 x 40 = 5.0, a decode's 0. A decode costs 1.0 (bucket
    # 4), a prefill 7.0 (bucket 64). Prefill A, nothing in flight, is launched at 4.0 whatever
    # its held_s: [4, 11]. Prefill B planned at 4.0 while A runs returns at 4 + 4 + 5 = 13.0:
    # A is collected then, B runs [13, 20]. Decode C planned at 13.0 takes no held time and
    # runs [20, 21]. Prefill D planned at 20.0 returns at 29.0: C is collected then, D runs
    # [29, 36]. Without the terms: A [4, 11], B [11, 18], C [18, 19] collected at 22, D [22, 29].
    coef = only_bucket_costs({"4": 1.0, "64": 7.0}, launch_prefill_s=4.0, held_prefill_s=4.0, held_prefill_token_s=0.025)
    d, p = decode_and_prefill()
    decode = make_plan(num_slots=4, decodes=[d], page_size=4)
    prefill = make_plan(num_slots=4, prefills=[p], page_size=4)
    for name, terms, spans in (
        ("h.json", True, [(4.0, 13.0), (13.0, 20.0), (20.0, 29.0), (29.0, 36.0)]),
        ("n.json", False, [(4.0, 11.0), (11.0, 18.0), (18.0, 22.0), (22.0, 29.0)]),
    ):
        if not terms:
            for k in ("held_prefill_s", "held_prefill_token_s"):
                coef.pop(k)
        cost = make_cost_model("profiled", MODEL, None, **configs(write_profile(tmp_path / name, coef, page_size=4,
                                                                                 num_slots=4)))  # fmt: skip
        assert (cost(decode).held_s, cost(prefill).held_s) == pytest.approx((0.0, 5.0 if terms else 0.0))
        timeline = Timeline(cost)
        a = timeline.launch(prefill, 0.0)
        b = timeline.launch(prefill, spans[0][0])
        assert timeline.land(a, covered=True) == pytest.approx(spans[0])
        c = timeline.launch(decode, spans[0][1])
        assert timeline.land(b, covered=True) == pytest.approx(spans[1])
        d_step = timeline.launch(prefill, spans[1][1])
        assert timeline.land(c, covered=True) == pytest.approx(spans[2])
        assert (d_step.begin, d_step.end) == pytest.approx(spans[3])


def test_rows_left_by_hand():
    from cbjax.sim.launch_terms import rows_left

    # 5 rows in flight; the plan carries on 3 (two decodes and a prefill's later chunk, context
    # 16) beside a new prompt (context 0): 2 left. Never below 0.
    assert rows_left(5, [(1, 10, True), (1, 20, True), (30, 0, False), (8, 16, False)]) == 2
    assert rows_left(1, [(1, 5, True), (1, 6, True)]) == 0
    assert rows_left(0, []) == 0


def test_a_launch_with_nothing_in_flight_starts_its_step_after_the_launch_by_hand(tmp_path):
    # launch_prefill_s 4.0 (0.25 a prefill row), a prefill costs 7.0 (bucket 64), a decode 1.0;
    # wake_s 0.5 over 1 s. The first plan, a prefill at 0, has nothing in flight: its step starts
    # after its launch (4.25), so it ends at 11.25, not 7.0. A decode planned at 11.25 is then no
    # idle loop (no wake). A prefill planned at 13.25 followed a 1 s idle (wake 0.5) and retires
    # nothing at its launch, though the decode's request is not in it: the step before was
    # collected already (launch_left_s, 100 a request, not charged).
    coef = only_bucket_costs({"4": 1.0, "64": 7.0}, wake_s=0.5, wake_ramp_s=1.0, launch_prefill_s=4.0,
                             launch_prefill_seq_s=0.25, launch_left_s=100.0)  # fmt: skip
    cost = make_cost_model("profiled", MODEL, None, **configs(write_profile(tmp_path / "w.json", coef, page_size=4,
                                                                             num_slots=4)))  # fmt: skip
    d, p = decode_and_prefill()
    prefill = make_plan(num_slots=4, prefills=[p], page_size=4)
    decode = make_plan(num_slots=4, decodes=[d], page_size=4)
    timeline = Timeline(cost)
    first = timeline.launch(prefill, 0.0)
    assert (first.time.total_s, first.time.launch_s) == pytest.approx((7.0, 4.25))
    assert timeline.land(first, covered=False) == pytest.approx((4.25, 11.25))
    second = timeline.launch(decode, 11.25)
    assert (second.time.total_s, second.time.launch_s) == pytest.approx((1.0, 0.0))
    assert timeline.land(second, covered=False) == pytest.approx((11.25, 12.25))
    later = timeline.launch(prefill, 13.25)
    assert (later.time.total_s, later.time.launch_s) == pytest.approx((7.5, 4.25))


def test_a_step_collected_with_nothing_behind_it_drains_and_the_next_plan_meets_an_idle_loop_by_hand(tmp_path):
    # drain_s 0.25. Decode 1 at 0 costs 1.0 (bucket 4); decode 2, planned at 0 while it runs,
    # begins at 1.0 and ends at 2.0, or at 1.25 if collected with nothing behind it. A prefill
    # (7.0) planned at 2.25 comes after that drained end: the loop idled 1 s (wake 0.5 x min(1,
    # 1 / 1)) and the step before was collected already, so the decode's request, not in the
    # prefill, retires at no launch (launch_left_s, 100 a request, not charged). The drain is
    # never above the plan's cost.
    coef = only_bucket_costs({"4": 1.0, "64": 7.0}, wake_s=0.5, wake_ramp_s=1.0, launch_left_s=100.0, drain_s=0.25)
    cfgs = configs(write_profile(tmp_path / "d.json", coef, page_size=4, num_slots=4))
    d, p = decode_and_prefill()
    decode = make_plan(num_slots=4, decodes=[d], page_size=4)
    prefill = make_plan(num_slots=4, prefills=[p], page_size=4)

    def run(plan_after: float, coefficients=None, name="x.json"):
        cost = make_cost_model("profiled", MODEL, None, **(cfgs if coefficients is None else configs(
            write_profile(tmp_path / name, coefficients, page_size=4, num_slots=4))))  # fmt: skip
        timeline = Timeline(cost)
        one = timeline.launch(decode, 0.0)
        two = timeline.launch(decode, 0.0)
        timeline.land(one, covered=True)
        if plan_after >= 2.0:  # planned after decode 2's collect, with nothing in flight
            timeline.land(two, covered=False)
            last = timeline.launch(prefill, plan_after)
        else:  # planned at decode 1's collect while decode 2 runs
            last = timeline.launch(prefill, plan_after)
            timeline.land(two, covered=True)
        return [x for s in (one, two, last) for x in (s.time.total_s, s.time.drain_s, s.time.launch_s)], (two.begin, two.end)

    steps, span = run(2.25)
    assert steps == pytest.approx([1.0, 0.25, 0.0, 1.0, 0.25, 0.0, 7.5, 0.25, 0.0]) and span == (1.0, 1.25)
    # the prefill planned at 1.0 (decode 1's collect) while decode 2 runs: no idle loop, and the
    # decode's request retires at its launch
    steps, _ = run(1.0)
    assert steps == pytest.approx([1.0, 0.25, 0.0, 1.0, 0.25, 0.0, 7.0, 0.25, 100.0])
    # a profile without drain_s: the step ends at 2.0, so a plan at 2.25 follows a 0.25 s idle
    coef.pop("drain_s")
    steps, span = run(2.25, coef, "none.json")
    assert steps == [1.0, None, 0.0, 1.0, None, 0.0, 7.125, None, 0.0] and span == (1.0, 2.0)
    coef["drain_s"] = 5.0
    steps, _ = run(2.25, coef, "long.json")
    assert steps[:3] == pytest.approx([1.0, 1.0, 0.0])


def test_a_stack_overhead_adds_its_host_time_to_a_drained_step_by_hand(tmp_path):
    # overhead step_s 0.5 on the profiled model (decode 1.0, drain 0.25): the step costs 1.5 and
    # drains in 0.75; the stack's host time is hidden by no launch behind it either
    from cbjax.config import OverheadConfig

    coef = only_bucket_costs({"4": 1.0, "64": 7.0}, drain_s=0.25)
    cfgs = configs(write_profile(tmp_path / "o.json", coef, page_size=4, num_slots=4))
    cost = make_cost_model("profiled", MODEL, None, overhead=OverheadConfig(name="test", step_s=0.5), **cfgs)
    d, _ = decode_and_prefill()
    time = cost(make_plan(num_slots=4, decodes=[d], page_size=4))
    assert (time.total_s, time.drain_s) == pytest.approx((1.5, 0.75))


def test_the_served_runs_recorder_notes_each_arrival_handed_to_the_scheduler():
    # serve_timed over a simulated executor on the wall clock: each of the workload's requests
    # reaches the scheduler once, and is noted then
    from cbjax.config import ExecutorConfig, LengthConfig, RunConfig, WorkloadConfig
    from cbjax.profile.serving import serve_timed
    from cbjax.sim.executor import SimExecutor

    wl = WorkloadConfig(num_requests=5, arrival="all_at_once", prompt_len=LengthConfig(dist="fixed", value=8, max=8),
                        output_len=LengthConfig(dist="fixed", value=3, max=3))  # fmt: skip
    cfg = RunConfig(model=MODEL, executor=ExecutorConfig(name="sim", cost_model="unit"), workload=wl, progress=False)
    timed = serve_timed(SimExecutor(make_cost_model("unit", MODEL, cfg.hardware)), cfg)
    assert len(timed.arrived) == 5 and timed.arrived == sorted(timed.arrived)
    assert timed.arrived[-1] <= timed.rows_at[0]  # all at once: every one before the first plan
    assert timed.dispatch == [None] * len(timed.launched)  # a simulated launch has no step call


def test_a_launch_s_step_call_is_read_off_the_engines_handle_alone():
    from cbjax.profile.serving import dispatch_s
    from cbjax.runtime.executor import Launched

    assert dispatch_s(Launched(rows=1, tokens=None, start=0.0, dispatch_s=2.5e-3)) == 2.5e-3
    assert dispatch_s(("tokens", 2.5e-3)) is None
