"""Modelling pieces behind the paper reproductions, checked by hand: tensor parallelism, swap
copy latency, padded static batches, hybrid batching off, KV sizing, truncated lengths."""

import dataclasses

import numpy as np
import pytest

from conftest import CheckingExecutor, make_plan, make_requests
from cbjax.cache.sizing import auto_num_pages
from cbjax.config import CacheConfig, HardwareConfig, LengthConfig, OverheadConfig, RunConfig, SchedulerConfig
from cbjax.engine.offline import serve
from cbjax.report.metrics import summarize
from cbjax.app.run import resolve
from cbjax.scheduler import Scheduler
from cbjax.sim import RooflineCost
from cbjax.workload.synthetic import sample_lengths
from test_cost_model import HW, MODEL, STACK, req

LOOSE = dict(max_num_batched_tokens=10_000)
BIG_CACHE = CacheConfig(num_pages=1000, page_size=4)


def test_tensor_parallel_splits_bytes_and_adds_two_ring_allreduces_per_layer():
    tp = dataclasses.replace(HW, num_devices=2, interconnect_bw=8.0)
    plan = make_plan(num_slots=2, decodes=[req(3, 1)])
    bytes_moved = 360 + (3 + 2) * 16  # as in test_roofline_decode_is_memory_bound_by_hand
    # 1 token x 1 layer x 2 all-reduces x ring 2(2-1)/2 = 1 x d_model 4 x 2 B, over 8 B/s
    allreduce = 1 * 1 * 2 * 1.0 * 4 * 2 / 8.0
    assert RooflineCost(MODEL, tp, STACK)(plan).total_s == pytest.approx(bytes_moved / (50 * 2) + allreduce + 0.25)


def test_swap_pays_a_copy_call_per_page_layer_and_k_or_v():
    hw = HardwareConfig(name="toy", peak_flops=1000.0, mem_bw=100.0, mem_bytes=1e9, host_bw=64.0)
    slow = OverheadConfig(copy_latency_s=0.5)
    plan = make_plan(num_slots=2, decodes=[req(3, 1)], page_size=4)
    plan.swap_out = [("r", (1, 2))]
    plan.swap_in = [("r", (5,))]
    # 3 pages x 1 layer x (K, V) = 6 copy calls of 0.5 s
    assert RooflineCost(MODEL, hw, slow)(plan).total_s == pytest.approx(RooflineCost(MODEL, hw)(plan).total_s + 6 * 0.5)


def test_padded_rows_replace_the_planned_rows_in_the_cost():
    cost = RooflineCost(MODEL, HW)
    plain = make_plan(num_slots=4, decodes=[req(7, 1), req(7, 1), req(7, 1)])
    padded = make_plan(num_slots=4, decodes=[req(2, 1)], padded_rows=[(1, 7, True)] * 3)
    assert cost(padded).total_s == pytest.approx(cost(plain).total_s)
    assert cost(padded).total_s > cost(make_plan(num_slots=4, decodes=[req(2, 1)])).total_s


class RecordingExecutor(CheckingExecutor):
    def __init__(self, scheduler):
        super().__init__(scheduler)
        self.rows = []

    def execute(self, plan):
        self.rows.append(plan.cost_rows())
        return super().execute(plan)


def test_static_padding_charges_finished_rows_at_the_padded_length_by_hand():
    cfg = SchedulerConfig(name="static", max_num_seqs=2, static_padding=True, **LOOSE)
    sched = Scheduler(cfg, BIG_CACHE, 1000)
    reqs = make_requests([1, 3, 2], prompt_lens=[3, 5, 4])
    executor = RecordingExecutor(sched)
    serve(reqs, sched, executor)
    assert executor.rows == [
        [(5, 0, False)] * 2,  # batch {0, 1}: both prompts padded to 5
        [(1, 5, True)] * 2,  # request 0 finished at its prefill, still computed
        [(1, 6, True)] * 2,
        [(4, 0, False)],  # batch {2}
        [(1, 4, True)],
    ]
    # unpadded static charges what each row really does
    sched = Scheduler(dataclasses.replace(cfg, static_padding=False), BIG_CACHE, 1000)
    executor = RecordingExecutor(sched)
    serve(make_requests([1, 3, 2], prompt_lens=[3, 5, 4]), sched, executor)
    assert executor.rows[:3] == [[(3, 0, False), (5, 0, False)], [(1, 5, True)], [(1, 6, True)]]


def test_static_padding_errors_name_the_keys():
    with pytest.raises(ValueError, match="scheduler.static_padding.*scheduler=static"):
        SchedulerConfig(name="fcfs", static_padding=True)
    with pytest.raises(ValueError, match="scheduler.static_padding.*scheduler.chunked_prefill"):
        SchedulerConfig(name="static", static_padding=True, chunked_prefill=True)


@pytest.mark.parametrize(
    "override, key",
    [
        ({"scheduler": {"preemption": "swap"}}, "scheduler.preemption"),
        ({"cache": {"host_pages": 64}}, "cache.host_pages"),
        ({"cluster": {"prefill_replicas": 1, "decode_replicas": 1}}, "cluster.prefill_replicas"),
    ],
)
def test_static_padding_rejects_kv_copied_in_naming_the_key(override, key):
    # A padded batch charges every row a prefill from its first token; a row whose K/V was
    # copied in (swap, host tier, a P/D transfer) would pay the copy and that prefill both.
    base = RunConfig(scheduler=SchedulerConfig(name="static", static_padding=True))
    groups = {name: dataclasses.replace(getattr(base, name), **kw) for name, kw in override.items()}
    with pytest.raises(ValueError, match=rf"scheduler.static_padding .*{key}"):
        dataclasses.replace(base, **groups)
    unpadded = dataclasses.replace(base, scheduler=dataclasses.replace(groups.get("scheduler", base.scheduler), static_padding=False))
    dataclasses.replace(unpadded, **{k: v for k, v in groups.items() if k != "scheduler"})  # static alone takes it


@pytest.mark.parametrize("hybrid, finish", [(True, 3.0), (False, 4.0)])
def test_without_hybrid_batching_a_prefill_iteration_stalls_decodes(hybrid, finish):
    # A (output 3) prefills at t=0 and decodes at t=1; B arrives at 1.5 and prefills at t=2:
    # mixed with A's decode (hybrid), or alone while A waits (not hybrid).
    sched = Scheduler(SchedulerConfig(max_num_seqs=4, hybrid_batching=hybrid, **LOOSE), BIG_CACHE, 1000)
    a, b = make_requests([3, 2], prompt_lens=[4, 4], arrivals=[0.0, 1.5])
    serve([a, b], sched, CheckingExecutor(sched))
    assert a.finish_s == finish and b.first_token_s == 3.0


def test_auto_num_pages_is_memory_left_after_weights_over_page_bytes():
    # weights 180 params x 2 B = 360 B; KV 16 B per token, pages of 4 tokens: 64 B
    hw = dataclasses.replace(HW, mem_bytes=1000.0)
    assert auto_num_pages(MODEL, hw, 4, 0.9) == (900 - 360) // 64
    assert auto_num_pages(MODEL, dataclasses.replace(hw, num_devices=2), 4, 0.9) == (1800 - 360) // 64
    with pytest.raises(ValueError, match="cache.num_pages=auto"):
        auto_num_pages(MODEL, dataclasses.replace(hw, mem_bytes=400.0), 4, 0.9)
    cfg = RunConfig(model=MODEL, hardware=hw, cache=CacheConfig(num_pages="auto", page_size=4))
    assert resolve(cfg).cache.num_pages == 8
    with pytest.raises(ValueError, match="cache.num_pages"):
        CacheConfig(num_pages="lots")


def test_resample_redraws_into_range_where_clip_piles_at_the_bounds():
    base = dict(dist="exponential", mean=100.0, min=50, max=60)
    rng = np.random.default_rng(0)
    clip = sample_lengths(LengthConfig(**base), 10_000, rng)
    resample = sample_lengths(LengthConfig(**base, truncation="resample"), 10_000, rng)
    assert clip.min() >= 50 and resample.min() >= 50 and resample.max() <= 60
    # clip: P(draw <= 50) = 1 - e^-0.5 ~ 39% lands on 50; resample: ~1/11 per value
    assert (clip == 50).mean() > 0.35
    assert 0.06 < (resample == 50).mean() < 0.12
    with pytest.raises(ValueError, match="truncation"):
        LengthConfig(truncation="fold").check("workload.output_len")
    with pytest.raises(ValueError, match="almost never"):
        sample_lengths(LengthConfig(dist="fixed", value=5, min=10, max=20, truncation="resample"), 3, rng)


def test_normalized_latency_is_the_mean_of_e2e_over_output_length():
    # one slot: A (output 2) ends at 2 -> 1.0 s/token; B (output 4) runs from 2 to 6 -> 1.5
    sched = Scheduler(SchedulerConfig(max_num_seqs=1, **LOOSE), BIG_CACHE, 1000)
    reqs = make_requests([2, 4])
    s = summarize(serve(reqs, sched, CheckingExecutor(sched)))
    assert s["normalized_latency_s_per_token"] == pytest.approx(1.25)


def test_per_sequence_and_per_page_overheads_by_hand():
    base = RooflineCost(MODEL, HW)
    knobs = RooflineCost(MODEL, HW, OverheadConfig(seq_s=0.5, page_s=0.125))
    plan = make_plan(num_slots=4, decodes=[req(3, 1), req(7, 1)], prefills=[req(0, 5)], page_size=4)
    # 3 sequences x 0.5 s; pages read: ceil(4/4) + ceil(8/4) + ceil(5/4) = 5, x 0.125 s
    assert knobs(plan).total_s == pytest.approx(base(plan).total_s + 3 * 0.5 + 5 * 0.125)


def test_time_between_tokens_counts_every_gap_stalls_included():
    # unit cost; A (output 3) decodes at t=1 and t=2; B (prompt 4, output 2) arrives at 0.5 and
    # prefills at t=1 beside A's decode. Without hybrid batching A's decode waits a step.
    for hybrid, gaps in [(True, [1.0, 1.0, 1.0]), (False, [2.0, 1.0, 1.0])]:
        sched = Scheduler(SchedulerConfig(max_num_seqs=4, hybrid_batching=hybrid, **LOOSE), BIG_CACHE, 1000)
        a, b = make_requests([3, 2], prompt_lens=[4, 4], arrivals=[0.0, 0.5])
        s = summarize(serve([a, b], sched, CheckingExecutor(sched)))
        assert sorted(sched.tbt_s) == sorted(gaps)
        assert s["tbt_s_p50"] == pytest.approx(float(np.percentile(gaps, 50)))
        assert s["tbt_s_mean"] == pytest.approx(np.mean(gaps))


@pytest.mark.parametrize("alternate, a_finish, c_finish", [(False, 5.0, 3.0), (True, 4.0, 5.0)])
def test_alternating_phases_interleave_decodes_with_waiting_prefills(alternate, a_finish, c_finish):
    # budget 4 = one prompt of 4 per iteration; B and C (output 1) wait while A (output 3) runs
    cfg = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=4, hybrid_batching=False, alternate_phases=alternate)
    sched = Scheduler(cfg, BIG_CACHE, 1000)
    a, b, c = make_requests([3, 1, 1], prompt_lens=[4, 4, 4], arrivals=[0.0, 0.5, 0.5])
    serve([a, b, c], sched, CheckingExecutor(sched))
    assert (a.finish_s, c.finish_s) == (a_finish, c_finish)


def test_h100_and_h200_tensor_parallelism_runs_over_nvlink4_by_hand():
    from cbjax.cluster.pools import load_hardware
    from cbjax.config import ModelConfig

    # Llama-3-8B's shape: 32 layers of d_model 4096, bf16
    llama3_8b = ModelConfig(
        name="llama3_8b", vocab_size=128256, d_model=4096, num_layers=32, num_heads=32, num_kv_heads=8,
        head_dim=128, ffn_dim=14336, max_model_len=8192, dtype="bfloat16",
    )  # fmt: skip
    plan = make_plan(num_slots=1, prefills=[req(0, 512)])
    for name in ("h100_sxm", "h200"):
        hw = load_hardware(name, "hardware")
        # NVLink 4: 900 GB/s per GPU both ways (datasheet), 450e9 each way; the A100's NVLink 3
        # (300e9 each way) is not this part's
        assert hw.interconnect_bw == 450e9
        one, two = RooflineCost(llama3_8b, hw), RooflineCost(llama3_8b, dataclasses.replace(hw, num_devices=2))
        # TP2 halves the 512-token prefill (compute-bound on both) and adds the all-reduces:
        # 512 tokens x 32 layers x 2 x 4096 x 2 B = 268,435,456 B, ring 2(2-1)/2 = 1, over 450e9 B/s
        allreduce = 512 * 32 * 2 * 4096 * 2 * 1.0 / 450e9
        assert allreduce == pytest.approx(0.000596523)
        assert two(plan).total_s == pytest.approx(one(plan).total_s / 2 + allreduce)
    # the H100's whole TP2 step: matmuls 512 x 2 x 6,979,588,096 body + 2 x 525,336,576 head
    # FLOPs (6.0230 ms) and attention 131,328 pairs x 524,288 FLOPs (0.0580 ms) at 2 x 989e12 x
    # 0.6, plus the all-reduces (0.5965 ms)
    assert RooflineCost(llama3_8b, dataclasses.replace(load_hardware("h100_sxm", "hardware"), num_devices=2))(
        plan
    ).total_s == pytest.approx(0.0066776, rel=1e-4)
