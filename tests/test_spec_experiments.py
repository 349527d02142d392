"""The speculative-decoding experiments: each config loads, every arm and reproduction row is
valid, and the mechanisms their rows rest on show in cut-down runs."""

import pytest
from hydra import compose, initialize_config_dir

from cbjax.app.cli import CONFIG_DIR, to_run_config
from cbjax.app.run import resolve, run_single, summary_keys, with_overrides
from cbjax.report.reproduction import check_entries, evaluate


def experiment(name, *overrides):
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        return to_run_config(compose(config_name="config", overrides=[f"experiment={name}", "progress=false", *overrides]))


def run_arms(cfg, arms, **extra):
    return {a: run_single(with_overrides(with_overrides(cfg, cfg.experiment.arms[a]), extra), verbose=False) for a in arms}


@pytest.mark.parametrize("name", ["spec_decode_load", "spec_acceptance"])
def test_every_arm_and_reproduction_row_is_well_formed(name):
    cfg = experiment(name)
    assert cfg.experiment.name == name and cfg.experiment.reproduction
    arm_cfgs = {arm: with_overrides(cfg, o, where=f"{name}.{arm}") for arm, o in cfg.experiment.arms.items()}
    for arm_cfg in arm_cfgs.values():
        resolve(arm_cfg)
    check_entries(cfg.experiment.reproduction, {arm: summary_keys(c) for arm, c in arm_cfgs.items()})


def test_spec_acceptance_arms_meet_the_closed_form():
    cfg = experiment("spec_acceptance", "workload.num_requests=40", "workload.output_len.value=1500")
    arms = ["a05_k3", "a09_k5"]
    summaries = run_arms(cfg, arms)
    rows = [r for r in evaluate(cfg.experiment.reproduction, {a: summaries.get(a, {}) for a in cfg.experiment.arms})
            if r["setting"] in ("alpha 0.5, k 3", "alpha 0.9, k 5")]  # fmt: skip
    assert [r["verdict"] for r in rows] == ["pass", "pass"]


def test_fixed_speculation_helps_at_low_load_and_hurts_at_high_load():
    cfg = experiment("spec_decode_load", "workload.num_requests=200")
    s = run_arms(cfg, ["none_r4", "k3_r4", "none_r96", "k5_r96", "goodput_r96", "k1_r96"])
    assert s["k3_r4"]["e2e_s_mean"] < 0.8 * s["none_r4"]["e2e_s_mean"]
    assert s["k5_r96"]["e2e_s_mean"] > s["none_r96"]["e2e_s_mean"]
    best = min(s[a]["e2e_s_mean"] for a in ("none_r96", "k5_r96", "k1_r96"))
    assert s["goodput_r96"]["e2e_s_mean"] <= 1.05 * best
