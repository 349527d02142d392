"""The cluster reproductions: each config composes, its arms and rows are valid, reproduce.py
finds it, and cut-down runs show the mechanism its rows rest on."""

import sys

import pytest
from hydra import compose, initialize_config_dir

from conftest import REPO
from cbjax.app.cli import CONFIG_DIR, to_run_config
from cbjax.report.reproduction import check_entries
from cbjax.app.run import run_single, summary_keys, with_overrides

EXPERIMENTS = ["distserve_goodput", "prefix_routing", "splitwise_hetero"]


def experiment(name, *overrides):
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        return to_run_config(
            compose(config_name="config", overrides=[f"experiment={name}", "progress=false", *overrides])
        )


def arm(cfg, name, **extra):
    return run_single(with_overrides(with_overrides(cfg, cfg.experiment.arms[name]), extra), verbose=False)


@pytest.mark.parametrize("name", EXPERIMENTS)
def test_arms_and_rows_are_valid_and_reproduce_finds_it(name):
    cfg = experiment(name)
    arms = {a: with_overrides(cfg, o, where=f"{name}.{a}") for a, o in cfg.experiment.arms.items()}
    check_entries(cfg.experiment.reproduction, {a: summary_keys(c) for a, c in arms.items()})
    assert any(c.cluster.enabled for c in arms.values())
    sys.path.insert(0, str(REPO / "experiments"))
    import reproduce

    assert name in reproduce.discover()


def test_distserve_pd_holds_its_slos_where_colocated_falls_behind():
    cfg = experiment("distserve_goodput", "workload.num_requests=200")
    colocated, pd = arm(cfg, "colocated_r6"), arm(cfg, "pd_r6")
    assert pd["slo_attainment"] >= 0.95 > colocated["slo_attainment"]
    assert [r["role"] for r in pd["replicas"]] == ["prefill", "decode", "decode"]
    assert pd["kv_transfers"] > 0 and pd["tpot_s_p90"] < colocated["tpot_s_p90"]


def test_prefix_routing_raises_the_hit_rate_and_cuts_ttft():
    cfg = experiment("prefix_routing", "workload.num_requests=200")
    rr, pa = arm(cfg, "round_robin"), arm(cfg, "prefix_affinity")
    assert pa["prefix_cache_hit_rate"] > rr["prefix_cache_hit_rate"] + 0.2
    assert pa["ttft_s_mean"] < rr["ttft_s_mean"]


def test_splitwise_a100_decode_pool_is_slower_per_token_but_within_the_slo():
    cfg = experiment("splitwise_hetero", "workload.limit=150")
    hh, ha = arm(cfg, "pd_hh_2_1"), arm(cfg, "pd_ha_2_1")
    assert [r["hardware"] for r in ha["replicas"]] == ["h100_sxm", "h100_sxm", "a100_80gb"]
    assert hh["tpot_s_p90"] < ha["tpot_s_p90"] < cfg.slo.tpot_s
