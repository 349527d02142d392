"""`cbjax.profile.latency`: the latency anchor's reference and speed by hand, its lone requests
served on a fixed-cost simulator, and `experiments/tier_fidelity.py` judging runs by it."""

import json
import sys

import pytest

from conftest import REPO, SCRIPT_PROFILE, FixedCost
from cbjax.config import CacheConfig, ModelConfig, RunConfig, SchedulerConfig
from cbjax.profile.latency import MIN_REFERENCE, lone_reference, lone_speed, serve_first_passes
from cbjax.profile.wake import PROMPT_SHARES, IDLES_S, wake_prompts
from cbjax.sim.executor import SimExecutor

sys.path.insert(0, str(REPO / "experiments"))
import tier_fidelity as tf  # noqa: E402


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


PROFILE = {**SCRIPT_PROFILE, "coefficients": dict.fromkeys(
    ("swap_out_iter_s", "swap_out_page_s", "swap_in_iter_s", "swap_in_page_s"), 1e-4),
    "served_wake": {"settings": {}, "requests": [lone(0, 16, 0.002)] * MIN_REFERENCE}}  # fmt: skip


def fake_cells(monkeypatch):
    """Engine runs of both cells, the second of each slow; the simulator at the fast runs'."""
    made = {"exponential": 0, "pareto": 0}

    def fake_run(cfg, out_dir=None, verbose=True):
        if cfg.executor.name == "sim":
            return {"ttft_s_p50": 0.010, "throughput_tok_s": 200.0}
        dist = cfg.workload.pause.dist
        made[dist] += 1
        return {"ttft_s_p50": 0.020 if made[dist] == 2 else 0.010, "throughput_tok_s": 200.0}

    monkeypatch.setattr(tf, "run_single", fake_run)


def test_tier_cells_are_judged_by_the_latency_anchor_by_default(tmp_path, monkeypatch, capsys):
    # the latency anchor (reference 1) before the first run and after each: round 2's runs (the
    # slow ones) sit between 1.0 and 1.3 and 1.3 and 1.0; the burst anchor is never asked
    speeds = iter([1.0, 1.0, 1.0, 1.3, 1.0, 1.0, 1.0])
    seen = {}

    def timer(cfg, reference):
        seen["reference"] = reference
        return lambda: next(speeds)

    monkeypatch.setattr(tf, "lone_timer", timer)
    monkeypatch.setattr(tf, "profile_anchor", lambda *a: pytest.fail("the burst anchor judged a latency cell"))
    fake_cells(monkeypatch)
    profile = tmp_path / "profile.json"
    profile.write_text(json.dumps(PROFILE))
    out = tmp_path / "tier.json"
    tf.main(["--profile", str(profile), "--runs", "2", "--out", str(out)])
    assert seen["reference"] == {16: 0.002}
    assert "judged by the latency anchor" in capsys.readouterr().out
    for cell in json.loads(out.read_text())["cells"].values():
        assert [e["on_speed"] for e in cell["engine"]] == [True, False, True]
        assert cell["verdict"]["ttft_s_p50"]["engine_range"] == [0.010, 0.010] and cell["verdict"]["ttft_s_p50"]["pass"]


def test_the_burst_anchor_judges_when_asked_or_without_lone_requests(tmp_path, monkeypatch, capsys):
    calls = []
    monkeypatch.setattr(tf, "lone_timer", lambda *a: pytest.fail("the latency anchor was built"))
    monkeypatch.setattr(tf, "profile_anchor", lambda base, profile, where: (calls.append(where), (None, None))[1])
    fake_cells(monkeypatch)
    with_lone, without = tmp_path / "with.json", tmp_path / "without.json"
    with_lone.write_text(json.dumps(PROFILE))
    without.write_text(json.dumps({k: v for k, v in PROFILE.items() if k != "served_wake"}))
    tf.main(["--profile", str(with_lone), "--runs", "1", "--anchor", "burst", "--out", str(tmp_path / "a.json")])
    tf.main(["--profile", str(without), "--runs", "1", "--out", str(tmp_path / "b.json")])
    assert calls == [str(with_lone), str(without)]
    assert "runs judged by the burst anchor" in capsys.readouterr().out
