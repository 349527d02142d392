"""Cut-down runs of the paper-reproduction experiments: each config loads, every arm is valid,
and the mechanism each paper result rests on shows at a few dozen requests."""

import pytest
from hydra import compose, initialize_config_dir

from cbjax.app.cli import CONFIG_DIR, to_run_config
from cbjax.report.metrics import KV_SHARES
from cbjax.app.run import resolve, run_single, with_overrides

EXPERIMENTS = [
    "vllm_kv_utilization",
    "vllm_batch_size",
    "vllm_block_size",
    "vllm_recompute_vs_swap",
    "anyscale_output_cap",
    "sarathi_ablation",
]


def experiment(name, *overrides):
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        return to_run_config(compose(config_name="config", overrides=[f"experiment={name}", "progress=false", *overrides]))


def run_arms(cfg, arms, **extra):
    """Each arm's summary, with `extra` dotted overrides applied after the arm's own."""
    return {a: run_single(with_overrides(with_overrides(cfg, cfg.experiment.arms[a]), extra), verbose=False) for a in arms}


@pytest.mark.parametrize("name", EXPERIMENTS)
def test_every_arm_and_reproduction_row_is_well_formed(name):
    cfg = experiment(name)
    assert cfg.experiment.name == name and cfg.experiment.reproduction
    for arm, overrides in cfg.experiment.arms.items():
        resolve(with_overrides(cfg, overrides, where=f"{name}.{arm}"))
    for row in cfg.experiment.reproduction:
        named = [row["arm"]] if "arm" in row else list(row["arms"])
        named += [row["ratio_to"]] if row.get("ratio_to") else []
        named += list(row.get("paper_set", []))
        assert set(named) <= set(cfg.experiment.arms), row
        assert row["kind"] in ("ordering", "argmin_in") if "arms" in row else isinstance(row["paper"], float)


def test_kv_utilization_orders_the_reservations_and_shares_sum_to_one():
    cfg = experiment("vllm_kv_utilization")
    s = run_arms(cfg, ["orca_max", "orca_pow2", "orca_oracle", "vllm"], **{"workload.num_requests": 80})
    token = [s[a]["kv_share_token_states"] for a in ("orca_max", "orca_pow2", "orca_oracle", "vllm")]
    assert token == sorted(token) and len(set(token)) == 4
    for summary in s.values():
        assert sum(summary[k] for k in KV_SHARES) == pytest.approx(1.0)
    assert s["vllm"]["kv_share_external_frag"] == 0.0 and s["vllm"]["kv_share_internal_frag"] < 0.01


def test_batch_size_orca_max_holds_at_most_seven_reservations():
    # OPT-13B on 40 GiB at 90%: (38.65e9 - 25.71e9 B of weights) / (16 x 819,200 B) = 989 pages;
    # Max reserves 2,047 tokens = 128 pages, buddy-aligned at 1 + 128k: 7 places in 988 pages.
    cfg = experiment("vllm_batch_size")
    s = run_arms(cfg, ["sharegpt_orca_max", "alpaca_orca_max", "sharegpt_vllm"], **{"workload.num_requests": 80})
    assert s["sharegpt_orca_max"]["num_pages"] == 989
    assert s["sharegpt_orca_max"]["peak_batch_size"] == s["alpaca_orca_max"]["peak_batch_size"] == 7
    assert s["sharegpt_vllm"]["mean_batch_size"] > s["sharegpt_orca_max"]["mean_batch_size"]


def test_block_size_large_pages_fragment_and_small_pages_pay_per_page():
    # the calibrated arms carry the per-page attention cost (overhead=vllm_0_1, page_s)
    cfg = experiment("vllm_block_size")
    arms = ["alpaca_p1_calibrated", "alpaca_p16_calibrated", "alpaca_p256_calibrated"]
    s = run_arms(cfg, arms, **{"workload.num_requests": 200})
    frag = [s[a]["kv_share_internal_frag"] for a in arms]
    assert frag[0] == 0.0 and frag[0] < frag[1] < frag[2]
    assert s[arms[0]]["num_pages"] == 15836 and s[arms[2]]["num_pages"] == 61
    # with a per-page attention cost, one-token pages are slower than 16-token ones
    assert s[arms[0]]["normalized_latency_s_per_token"] > s[arms[1]]["normalized_latency_s_per_token"]


def test_recompute_vs_swap_small_pages_make_swapping_slow():
    # the calibrated arms carry the fixed cost per host copy (overhead=vllm_0_1, copy_latency_s)
    cfg = experiment("vllm_recompute_vs_swap", "workload.arrival=all_at_once")
    recompute, swap = "recompute_p1_calibrated", "swap_p1_calibrated"
    s = run_arms(cfg, [recompute, swap], **{"workload.num_requests": 150})
    assert s[recompute]["swap_preemptions"] == 0 < s[recompute]["preemptions"]
    assert s[swap]["swap_preemptions"] > 0
    assert s[swap]["normalized_latency_s_per_token"] > s[recompute]["normalized_latency_s_per_token"]


def test_anyscale_padding_costs_static_and_continuous_wins():
    cfg = experiment("anyscale_output_cap")
    s = run_arms(cfg, ["static_c128", "continuous_c128"], **{"workload.num_requests": 48})
    unpadded = run_arms(cfg, ["static_c128"], **{"workload.num_requests": 48, "scheduler.static_padding": False})
    assert s["static_c128"]["iterations"] == unpadded["static_c128"]["iterations"]
    assert s["static_c128"]["makespan_s"] > unpadded["static_c128"]["makespan_s"]
    assert s["continuous_c128"]["throughput_tok_s"] > 2 * s["static_c128"]["throughput_tok_s"]


def test_sarathi_hybrid_and_chunked_give_the_best_tail_tbt():
    cfg = experiment("sarathi_ablation")
    s = run_arms(cfg, ["hybrid_only", "chunked_only", "both"], **{"workload.num_requests": 60})
    assert s["both"]["tbt_s_p99"] < min(s["hybrid_only"]["tbt_s_p99"], s["chunked_only"]["tbt_s_p99"])
    assert s["hybrid_only"]["ttft_s_p50"] < s["chunked_only"]["ttft_s_p50"]


def test_calibrated_knobs_slow_what_they_model():
    # generate's per-step overhead lengthens the naive static run; alternating phases delay
    # chunked-only's first tokens behind decode iterations
    cfg = experiment("anyscale_output_cap")
    s = run_arms(cfg, ["static_c128", "static_c128_calibrated"], **{"workload.num_requests": 24})
    base, calibrated = s["static_c128"], s["static_c128_calibrated"]
    assert calibrated["iterations"] == base["iterations"]
    # 0.083 s more per iteration (overhead=hf_generate, 0.085, instead of step_2ms, 0.002), all queued at t=0
    assert calibrated["makespan_s"] > base["makespan_s"] + 0.05 * base["iterations"]
    cfg = experiment("sarathi_ablation")
    s = run_arms(cfg, ["chunked_only", "chunked_only_calibrated"], **{"workload.num_requests": 60})
    assert s["chunked_only_calibrated"]["ttft_s_p50"] > s["chunked_only"]["ttft_s_p50"]
