"""Cost models checked against hand-computed iteration times."""

import pytest

from conftest import make_plan
from cbjax.config import HardwareConfig, ModelConfig, OverheadConfig
from cbjax.core.request import Request
from cbjax.scheduler.core import Schedule
from cbjax.sim import RooflineCost, UnitCost, make_cost_model

# One layer, no embeddings to speak of: easy arithmetic.
MODEL = ModelConfig(
    name="toy", vocab_size=1, d_model=4, num_layers=1, num_heads=1, num_kv_heads=1, head_dim=4, ffn_dim=8, dtype="bfloat16"
)
HW = HardwareConfig(name="toy", peak_flops=1000.0, mem_bw=100.0, mem_bytes=1e9, flops_efficiency=0.5, bw_efficiency=0.5)
# a serving stack's host time per step (the overhead group), 0.25 s
STACK = OverheadConfig(name="toy", step_s=0.25)


def req(computed, new):
    r = Request("r", 0.0, 1)
    r.num_computed, r.num_new_tokens = computed, new
    return r


def test_param_count_by_hand():
    # attention 4*4*4 = 64, gated MLP 3*4*8 = 96, two norms 8, embed+head 2*1*4 = 8, final norm 4
    assert MODEL.num_params == 64 + 96 + 8 + 8 + 4
    assert MODEL.kv_bytes_per_token == 2 * 1 * 1 * 4 * 2


def test_unit_cost_is_one_second():
    assert UnitCost()(Schedule(num_slots=1)).total_s == 1.0


def test_roofline_decode_is_memory_bound_by_hand():
    cost = RooflineCost(MODEL, HW, STACK)
    plan = make_plan(num_slots=2, decodes=[req(3, 1)])
    # bytes: weights 180 params * 2 B = 360, KV read 3 + write 1 (+ the new one read) = 5 tokens * 16 B = 80
    bytes_moved = 360 + (3 + 2) * 16
    # flops: body 2*(180-8)=344 per token, head 2*4 = 8 per seq, attention 4*1*1*4 = 16 per pair, 4 pairs
    flops = 344 + 8 + 16 * 4
    assert flops / 500 < bytes_moved / 50
    assert cost(plan).total_s == pytest.approx(bytes_moved / 50 + 0.25)


def test_roofline_prefill_is_compute_bound_by_hand():
    hw = HardwareConfig(name="toy", peak_flops=1000.0, mem_bw=1e9, mem_bytes=1e9, flops_efficiency=0.5, bw_efficiency=0.5)
    cost = RooflineCost(MODEL, hw)
    plan = make_plan(num_slots=1, prefills=[req(0, 10)])
    flops = 10 * 344 + 8 + 16 * (10 * 11 / 2)
    assert cost(plan).total_s == pytest.approx(flops / 500)


def test_roofline_mixed_step_pays_matmuls_and_attention_each_at_its_bound_by_hand():
    cost = RooflineCost(MODEL, HW)
    plan = make_plan(num_slots=2, prefills=[req(0, 10)], decodes=[req(100, 1)])
    # weight matmuls: 11 tokens * 344 + 2 heads * 8 = 3800 FLOPs at 500/s (7.6 s) against
    # 360 B of weights at 50 B/s (7.2 s): bound by compute
    # attention: pairs 10*11/2 + (100 + 1) = 156 * 16 = 2496 FLOPs (4.992 s) against K/V
    # (0 + 10) + (100 + 1 + 1) = 112 tokens * 16 B = 1792 B (35.84 s): bound by memory
    assert cost(plan).total_s == pytest.approx(3800 / 500 + 1792 / 50)
    # one max over the whole step would hide the matmuls behind the K/V reads
    assert cost(plan).total_s > max((3800 + 2496) / 500, (360 + 1792) / 50)


def test_model_too_big_for_hardware_is_a_clear_error():
    big = ModelConfig(name="big", vocab_size=32000, d_model=4096, num_layers=32, num_heads=32, num_kv_heads=32, head_dim=128, ffn_dim=11008)
    with pytest.raises(ValueError, match="model big needs .* GB of weights, hardware toy has"):
        make_cost_model("roofline", big, HardwareConfig(name="toy", mem_bytes=1e9))
    with pytest.raises(ValueError, match="executor.cost_model"):
        make_cost_model("magic", MODEL, HW)


def test_roofline_swap_charges_page_bytes_over_the_host_link_by_hand():
    hw = HardwareConfig(name="toy", peak_flops=1000.0, mem_bw=100.0, mem_bytes=1e9, host_bw=64.0)
    cost = RooflineCost(MODEL, hw)
    plan = make_plan(num_slots=2, decodes=[req(3, 1)], page_size=4)
    without = cost(plan).total_s
    plan.swap_out = [("r", (1, 2))]
    plan.swap_in = [("r", (5,))]
    # 3 pages of 4 tokens at 16 B of K/V per token: 192 B over 64 B/s, after the step's time
    assert cost(plan).total_s == pytest.approx(without + 192 / 64)
    assert UnitCost()(plan).total_s == 1.0
    with pytest.raises(ValueError, match="hardware.host_bw"):
        HardwareConfig(host_bw=0.0)
