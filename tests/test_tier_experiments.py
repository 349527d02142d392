"""The KV-tier reproductions: each config composes, its arms and rows are valid, reproduce.py
finds it, and a cut-down `cbjax experiment=NAME` run writes its tables and reproduction rows
with the mechanism its rows rest on (host hits where a tier is, none without)."""

import json
import sys

import pytest
from hydra import compose, initialize_config_dir

from conftest import REPO
from cbjax.app.cli import CONFIG_DIR, to_run_config
from cbjax.app.run import run_experiment, summary_keys, with_overrides
from cbjax.report.reproduction import check_entries

# A few sessions on a small device pool, so that pages leave the device and the tier is used.
CUT_DOWN = {
    "multiturn_kv_tier": ["workload.num_sessions=12", "cache.num_pages=160", "workload.pause.mean=5"],
    "agentic_pauses": ["workload.num_sessions=6", "cache.num_pages=400", "workload.turns.high=8"],
}


def experiment(name, *overrides):
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        return to_run_config(
            compose(config_name="config", overrides=[f"experiment={name}", "progress=false", *overrides])
        )


@pytest.mark.parametrize("name", sorted(CUT_DOWN))
def test_arms_and_rows_are_valid_and_reproduce_finds_it(name):
    cfg = experiment(name)
    assert cfg.experiment.name == name and cfg.workload.name == "sessions"
    arms = {a: with_overrides(cfg, o, where=f"{name}.{a}") for a, o in cfg.experiment.arms.items()}
    check_entries(cfg.experiment.reproduction, {a: summary_keys(c) for a, c in arms.items()})
    sys.path.insert(0, str(REPO / "experiments"))
    import reproduce

    assert name in reproduce.discover()


def test_multiturn_cut_down_writes_its_tables_and_the_tier_serves_hits(tmp_path):
    cfg = experiment("multiturn_kv_tier", *CUT_DOWN["multiturn_kv_tier"])
    s = run_experiment(cfg, tmp_path, verbose=False)
    assert s["recompute"]["prefix_cache_hit_rate"] == 0.0
    assert "prefix_hit_rate_host" not in s["device_only"]
    assert s["host_256gb"]["prefix_hit_rate_host"] > 0
    assert s["host_256gb"]["prefix_cache_hit_rate"] > s["device_only"]["prefix_cache_hit_rate"]
    assert len(s["recompute"]["prefill_tok_s_by_turn"]) >= 2
    text = (tmp_path / "comparison.md").read_text()
    assert "TTFT p50 (s) by turn" in text and "Reproduction: paper vs ours" in text
    rows = json.loads((tmp_path / "reproduction.json").read_text())
    assert len(rows) == len(cfg.experiment.reproduction)


def test_agentic_cut_down_moves_host_traffic_only_with_a_tier(tmp_path):
    cfg = experiment("agentic_pauses", *CUT_DOWN["agentic_pauses"])
    s = run_experiment(cfg, tmp_path, verbose=False)
    assert "kv_host_bytes_loaded" not in s["no_tier"]
    for arm in ("lru", "session"):
        assert s[arm]["kv_host_bytes_stored"] > 0 and s[arm]["kv_host_bytes_loaded"] > 0
    assert (tmp_path / "reproduction.json").exists() and (tmp_path / "comparison.md").exists()
