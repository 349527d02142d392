"""`cbjax.profile.latency`: the latency anchor's reference and speed by hand, and its lone
requests served on a fixed-cost simulator (tests/test_tier_fidelity.py: the script judging
runs by it)."""

import pytest

from conftest import FixedCost
from cbjax.config import CacheConfig, ModelConfig, RunConfig, SchedulerConfig
from cbjax.profile.latency import MIN_REFERENCE, lone_reference, lone_speed, serve_first_passes
from cbjax.profile.wake import PROMPT_SHARES, IDLES_S, wake_prompts
from cbjax.sim.executor import SimExecutor


def lone(pass_, prompt_len, ttft):
    return {"pass": pass_, "prompt_len": prompt_len, "arrival_s": 0.0, "ttft_s": ttft, "idle_s": 0.02}


def test_the_reference_is_the_first_passes_median_per_prompt_length():
    rows = [lone(0, 12, t) for t in (1.0, 2.0, 3.0)] + [lone(2, 12, t) for t in (4.0, 5.0)]  # median 3.0
    rows += [lone(1, 12, 100.0)] * 9  # a second pass (idle loops of set lengths): not the reference
    rows += [lone(0, 64, t) for t in (2.0, 2.0, 6.0, 8.0)] + [lone(0, 64, None)] * 3  # 4 timed: too few
    rows += [lone(2, 128, t) for t in (1.0, 1.5, 2.0, 2.5, 3.0, 3.5)]  # median 2.25
    assert MIN_REFERENCE == 5
    assert lone_reference({"settings": {}, "requests": rows}) == {12: 3.0, 128: 2.25}
    assert lone_reference(None) == {} and lone_reference({"requests": []}) == {}


def test_the_speed_is_the_median_over_lengths_of_each_lengths_ratio():
    reference = {12: 2.0, 64: 2.0, 128: 1.0}
    # 12: median 2.0 -> 1.0; 64: median 4.0 -> 2.0; 128: median 1.1 -> 1.1; 256: no reference
    speed = lone_speed({12: [1.0, 2.0, 3.0], 64: [4.0, 4.0, 9.0], 128: [1.1], 256: [50.0]}, reference)
    assert speed == pytest.approx(1.1)
    with pytest.raises(ValueError, match="no prompt length"):
        lone_speed({256: [1.0]}, reference)


def test_first_passes_on_a_fixed_cost_simulator_take_one_step_each():
    model = ModelConfig(name="t", vocab_size=64, d_model=32, num_layers=1, num_heads=2, num_kv_heads=1,
                        head_dim=16, ffn_dim=64, max_model_len=256)  # fmt: skip
    cfg = RunConfig(model=model, scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=128),
                    cache=CacheConfig(num_pages=64, prefix_caching=True, host_pages=8), progress=False)  # fmt: skip
    # run to completion, 20 ms apart: each lone request's first token ends its prefill step, 1 ms
    ttfts = serve_first_passes(SimExecutor(FixedCost(0.001)), cfg, repeats=2)
    lengths = wake_prompts(cfg)
    assert len(lengths) == len(IDLES_S) * len(PROMPT_SHARES)
    assert sorted(ttfts) == sorted(set(lengths)) == [8, 16, 32, 64]  # 5%, 25%, 50%, 100% of 64 (8 at least)
    for values in ttfts.values():
        assert len(values) == 2 * len(IDLES_S) and values == pytest.approx([0.001] * len(values))
    assert lone_speed(ttfts, {8: 0.0005, 16: 0.0005, 32: 0.002, 64: 0.0005}) == pytest.approx(2.0)
