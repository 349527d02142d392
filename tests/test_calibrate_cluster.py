"""experiments/calibrate_cluster.py by hand (no engine run): the cells' configs, the host share
from its measurements, a cell's verdicts, the table and its place in docs/cluster.md."""

import sys

import pytest

from conftest import REPO
from cbjax.config import RunConfig

sys.path.insert(0, str(REPO / "experiments"))
import calibrate_cluster as cc  # noqa: E402


def test_cells_are_two_replicas_on_the_shared_prefix_workload_and_the_sim_shares_a_host():
    cfg = cc.cell_config(RunConfig(), "prefix_affinity")
    assert (cfg.cluster.replicas, cfg.cluster.router, cfg.cluster.host_share) == (2, "prefix_affinity", None)
    assert cfg.workload.name == "shared_prefix" and cfg.cache.prefix_caching and cfg.workload.arrival == "all_at_once"
    poisson = cc.with_rate(cfg, 40.0)
    assert (poisson.workload.arrival, poisson.workload.rate) == ("poisson", 40.0)
    sim = cc.cluster_sim_config(poisson, "p.json", 0.8)
    assert (sim.executor.name, sim.executor.cost_model, sim.executor.profile) == ("sim", "profiled", "p.json")
    assert sim.cluster.host_share == 0.8 and sim.cluster.router == "prefix_affinity"


def test_host_share_is_the_binding_of_the_driver_thread_and_the_cores():
    assert cc.host_share_of(0.5, 1.2, 2.0) == pytest.approx(0.6)  # the cores bind
    assert cc.host_share_of(0.7, 1.0, 2.0) == pytest.approx(0.7)  # the one driver thread binds
    assert cc.host_share_of(0.47, 0.99, 0.74) == 1.0  # a busy machine: capped at the whole host
    with pytest.raises(ValueError, match="cores must be > 0"):
        cc.host_share_of(0.5, 1.0, 0.0)


def test_share_fitted_so_the_simulated_ratios_are_the_engines():
    # a simulator whose 2 equal replicas serve 1/share times one (the turn model's symmetric case)
    def ideal(share):
        return min(2.0, 1.0 / share)

    def fitted(*ratios):
        return cc.share_for_ratios(list(ratios))

    assert fitted((1.25, ideal)) == pytest.approx(0.8, abs=1e-3)
    assert type(fitted((1.25, ideal))) is float  # it goes into configs and JSON
    # slower than one replica: beyond taking turns, up to MAX_SHARE
    assert fitted((0.9, ideal)) == pytest.approx(1 / 0.9, abs=1e-3)
    assert fitted((0.4, ideal)) == cc.MAX_SHARE == 2.0
    assert fitted((2.5, ideal)) == 0.5  # twice as fast or more: nothing binds
    # a simulator 10% slower at every share than that needs a smaller share for the same speedup
    assert fitted((1.25, lambda s: 0.9 * ideal(s))) == pytest.approx(0.72, abs=1e-3)
    # two ratios whose own roots are 0.8 (the speedup) and 1.35 (an E2E ratio of 2 x share, 2.7
    # on the engine): the least squares of their log errors is the geometric mean of the roots
    assert fitted((1.25, ideal), (2.7, lambda s: 2.0 * s)) == pytest.approx((0.8 * 1.35) ** 0.5, abs=1e-3)
    with pytest.raises(ValueError, match="an engine ratio must be > 0"):
        fitted((0.0, ideal))
    # the medians of the fit runs: lone 100, pair 125; the simulator's ratio at the share beside it
    runs = {"burst": ([{"throughput_tok_s": x} for x in (90.0, 100.0, 130.0)],
                      [{"throughput_tok_s": x} for x in (125.0, 80.0, 200.0)])}  # fmt: skip
    fit = cc.fit_host_share(runs, {"burst": ideal})
    burst = fit["fits"]["burst"]
    assert fit["host_share"] == pytest.approx(0.8, abs=1e-3) and (burst["lone"], burst["cluster"]) == (100.0, 125.0)
    assert burst["ratio"] == 1.25 and burst["simulated_ratio"] == pytest.approx(1.25, abs=2e-3) and burst["runs"] == 3
    with pytest.raises(ValueError, match="burst throughput_tok_s must be > 0"):
        cc.fit_host_share({"burst": ([{"throughput_tok_s": 0.0}], [{"throughput_tok_s": 1.0}])}, {"burst": ideal})


def test_the_fit_runs_are_not_the_cells():
    base = RunConfig()
    assert set(cc.fit_configs(base)) == {"burst"}  # before the Poisson rate is known
    configs = cc.fit_configs(base, 40.0)
    (lone, pair), (lone_p, pair_p) = configs["burst"], configs["poisson"]
    cell = cc.cell_config(base, "round_robin")
    for fit in (lone, pair, lone_p, pair_p):
        assert fit.workload.name == "synthetic" and not fit.cache.prefix_caching and fit.seed != cell.seed
    assert lone.workload.num_requests * 2 == pair.workload.num_requests == base.workload.num_requests
    assert (lone.cluster.replicas, pair.cluster.replicas, pair.cluster.router) == (1, 2, "round_robin")
    assert (lone.workload.arrival, pair.workload.arrival) == ("all_at_once", "all_at_once")
    # Poisson: the same requests, half the rate for the lone replica
    assert (lone_p.workload.arrival, lone_p.workload.rate, pair_p.workload.rate) == ("poisson", 20.0, 40.0)
    assert (lone_p.workload.num_requests, pair_p.workload.num_requests) == (lone.workload.num_requests, pair.workload.num_requests)


def _run(tp, e2e, hit=0.5):
    return {"throughput_tok_s": tp, "e2e_s_p50": e2e, "prefix_cache_hit_rate": hit}


def _report(cells):
    res = {"host_share": 0.75, "driver_share": 0.5, "process_cores": 1.5, "available_cores": 2.0, "cores": 2}
    fits = {"burst": {"lone": 100.0, "cluster": 125.0, "ratio": 1.25, "simulated_ratio": 1.25},
            "poisson": {"lone": 0.01, "cluster": 0.03, "ratio": 3.0, "simulated_ratio": 2.9}}  # fmt: skip
    host = {"host_share": 0.8, "requests_per_replica": 4, "poisson_rate_req_s": 5.0, "fits": fits, "resources": res}
    return {"profile": "p.json", "replicas": 2, "requests": 8, "repeats": 5, "host": host, "poisson_rate_req_s": 10.0,
            "load_average_at_end": [0.5, 0, 0], "date": "2026-12-05 07:00 UTC", "commit": "abc1234", "cells": cells}  # fmt: skip


def test_cell_verdicts_and_table_by_hand(tmp_path):
    runs = [_run(tp, e2e) for tp, e2e in zip([100, 101, 102, 103, 104], [1.0, 1.1, 1.2, 1.3, 1.4])]
    # burst: throughput 107 vs median 102 (+4.9%: pass); E2E p50 1.38 vs 1.2 (+15%: fail); with 5 runs
    # the bootstrap 90% interval of the median is their range (as tests/test_calibrate.py)
    burst = cc.judge_cluster_cell("round_robin", "burst", _run(107.0, 1.38), _run(204.0, 0.6), runs)
    assert burst["throughput_tok_s"]["verdict"] == "pass" and burst["e2e_s_p50"]["verdict"] == "fail"
    assert burst["throughput_tok_s"]["separate_error_pct"] == pytest.approx(100.0)  # 204 against 102
    # Poisson: E2E judged, throughput (the offered load) reported only
    poisson = cc.judge_cluster_cell("prefix_affinity", "poisson_50", _run(90.0, 1.26), _run(90.0, 0.6), runs)
    assert poisson["e2e_s_p50"]["verdict"] == "pass" and poisson["throughput_tok_s"]["verdict"] == "-"
    # a control cell fails, yet is not counted
    control = cc.judge_cluster_cell(cc.LONE, "burst", _run(50.0, 1.2), _run(50.0, 1.2), runs)
    assert control["control"] and control["throughput_tok_s"]["verdict"] == "fail"
    text = "\n".join(cc.table_lines(_report([burst, poisson, control])))
    assert "| round_robin, burst | throughput | 5 / 5 | 102 [100, 104] | 107 | +4.9 | yes (±5) | pass | 204 (+100.0) |" in text
    assert "| round_robin, burst | E2E p50 | 5 / 5 | 1.2 [1, 1.4] | 1.38 | +15.0 | no (±10) | fail | 0.6 (-50.0) |" in text
    assert "| prefix_affinity, poisson_50 | throughput | 5 / 5 | 102 [100, 104] | 90 | -11.8 | - | - | 90 (-11.8) |" in text
    assert "**Overall:** 2 of 3 judged figures of the 2-replica cells within target" in text
    assert "host share 0.800, fitted on runs of its own" in text and "Poisson arrivals at 5 req/s" in text
    assert "burst: a lone replica 100, 2 replicas 125 (throughput_tok_s), speedup 1.250 on the engine" in text
    assert "poisson: a lone replica 0.01, 2 replicas 0.03 (e2e_s_p50), E2E p50 ratio 3.000 on the engine, 2.900" in text
    assert "0.750 from resources" in text and "at commit abc1234" in text
    doc = tmp_path / "cluster.md"
    doc.write_text(f"# before\n{cc.DOC_BEGIN}\nold table\n{cc.DOC_END}\n# after\n")
    cc.write_doc(_report([burst]), doc)
    out = doc.read_text()
    assert out.startswith("# before\n") and out.endswith(f"{cc.DOC_END}\n# after\n") and "old table" not in out
    assert "| round_robin, burst | throughput |" in out
    (tmp_path / "plain.md").write_text("# no markers\n")
    with pytest.raises(ValueError, match="plain.md: no calibrate_cluster markers"):
        cc.write_doc(_report([burst]), tmp_path / "plain.md")


def test_docs_cluster_md_has_the_markers_and_fewer_than_five_repeats_are_refused(tmp_path):
    text = (REPO / "docs" / "cluster.md").read_text()
    assert text.count(cc.DOC_BEGIN) == 1 and text.count(cc.DOC_END) == 1
    with pytest.raises(SystemExit):
        cc.main(["--profile", str(tmp_path / "p.json"), "--repeats", "3"])


def test_runs_off_the_profiles_speed_leave_a_cell_short_and_failing():
    runs = [_run(100.0, 1.0)] * 2
    # 2 runs at the profile's speed of 9 made, 5 wanted: +1% still fails; none at all: unmeasured
    short = cc.judge_cluster_cell("round_robin", "burst", _run(101.0, 1.0), _run(101.0, 1.0), runs, 5, 9)
    assert short["throughput_tok_s"]["verdict"] == "fail" and (short["runs_judged"], short["runs"]) == (2, 9)
    none = cc.judge_cluster_cell("round_robin", "burst", _run(101.0, 1.0), _run(101.0, 1.0), [], 5, 9)
    assert none["throughput_tok_s"]["verdict"] == "fail" and none["throughput_tok_s"]["engine"] is None
    text = "\n".join(cc.table_lines(_report([short, none])))
    assert "| round_robin, burst | throughput | 0 / 9 | no run at the profile's speed | 101 | - | no (±5) | fail | - |" in text
    assert "**Overall:** 0 of 4 judged figures of the 2-replica cells within target" in text
