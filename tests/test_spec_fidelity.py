"""experiments/spec_fidelity.py's pure parts by hand: the half-capacity rate, the figure's verdict,
the table's cells, which runs share a simulation, and what a profile lacks for speculation."""

import json
import math
import sys

import pytest

from conftest import REPO, SCRIPT_PROFILE

sys.path.insert(0, str(REPO / "experiments"))
import spec_fidelity as sf  # noqa: E402


def test_half_capacity_is_half_the_bursts_request_rate():
    assert sf.half_capacity_rate(40.0) == 20.0
    assert sf.half_capacity_rate(7) == 3.5
    for bad in (0.0, -3.0, math.nan, math.inf, None):
        with pytest.raises(ValueError, match="throughput_req_s"):
            sf.half_capacity_rate(bad)


def test_figure_verdict_by_hand():
    # engine 90, 96, 100, 104, 110: median 100, range 90-110; the simulator 103 is +3%
    engine = [100.0, 96.0, 104.0, 90.0, 110.0]
    j = sf.judge_figure(engine, [103.0], 5.0)
    assert (j["engine_median"], j["engine_range"], j["simulator"]) == (100.0, [90.0, 110.0], 103.0)
    assert j["error_pct"] == pytest.approx(3.0) and j["pass"] is True
    # -6% fails 5% and passes 10%; exactly at the target passes
    assert sf.judge_figure(engine, [94.0], 5.0)["pass"] is False
    assert sf.judge_figure(engine, [94.0], 10.0)["pass"] is True
    assert sf.judge_figure([100.0], [105.0], 5.0)["pass"] is True
    # several simulations (one per distinct trace): their median; an even count averages the middle two
    assert sf.judge_figure(engine, [101.0, 109.0, 103.0], 5.0)["simulator"] == 103.0
    assert sf.judge_figure([2.0, 4.0], [3.3], 10.0)["error_pct"] == pytest.approx(10.0)
    # E2E p50 in seconds: 0.2 median, 0.181 is -9.5%
    e2e = sf.judge_figure([0.18, 0.2, 0.22], [0.181], 10.0)
    assert e2e["error_pct"] == pytest.approx(-9.5) and e2e["pass"] is True
    assert sf.judge_figure(engine, [150.0], None)["pass"] is None  # no target: not judged
    with pytest.raises(ValueError):
        sf.judge_figure([], [1.0], 5.0)


def test_cell_and_table_rows_by_hand():
    engine = [{"throughput_tok_s": t, "e2e_s_p50": e, "spec_acceptance_rate": a}
              for t, e, a in ((1000.0, 2.0, 0.6), (1100.0, 2.2, 0.6), (900.0, 1.8, 0.62))]  # fmt: skip
    sims = [{"throughput_tok_s": 1080.0, "e2e_s_p50": 2.5, "spec_acceptance_rate": None}] * 3
    cell = sf.judge_cell("burst", engine, sims)
    assert cell["throughput_tok_s"]["error_pct"] == pytest.approx(8.0) and cell["throughput_tok_s"]["pass"] is False
    assert cell["e2e_s_p50"]["error_pct"] == pytest.approx(25.0) and cell["e2e_s_p50"]["pass"] is False
    assert cell["engine_acceptance_rate"] == 0.6 and cell["simulator_acceptance_rate"] is None
    rows = sf.table_rows([cell])
    assert rows == [
        ["burst", "throughput (tok/s)", "1000 [900, 1100]", "1080", "+8.0%", "FAIL (±5%)"],
        ["burst", "E2E p50 (s)", "2 [1.8, 2.2]", "2.5", "+25.0%", "FAIL (±10%)"],
    ]


def test_runs_with_equal_traces_share_a_simulation():
    assert sf.trace_groups(["a", "b", "a", "c", "b"]) == [0, 1, 0, 3, 1]
    assert sf.trace_groups(["x"] * 4) == [0, 0, 0, 0]


def test_a_profile_without_verify_steps_or_loop_time_is_named():
    verify4 = {"kind": "verify", "rows": 2, "tokens": 8}
    ok = {"steps": [{"kind": "decode", "rows": 2, "tokens": 2}, verify4], "gaps": [[2, 1e-4]]}
    assert sf.check_profile(ok, 3) == []
    # verify steps of another k, and a pipelined profile's served runs (no gaps)
    other_k = {"steps": [{"kind": "verify", "rows": 2, "tokens": 4}], "gaps": [[2, 1e-4]]}
    assert sf.check_profile(other_k, 3) == ["its grid has no verify step of 1 + 3 tokens per row"]
    problems = sf.check_profile({"steps": [verify4], "gaps": []}, 3)
    assert len(problems) == 1 and "pipelined" in problems[0]
    assert len(sf.check_profile({"steps": []}, 3)) == 2


def test_only_runs_at_the_profiles_speed_are_judged(tmp_path, monkeypatch, capsys):
    # the profile's anchor (reference 1.0) timed before the first run and after each, in rounds
    # of (burst, poisson_50): round 1's poisson run sits between 1.0 and 1.3 (off speed), round
    # 2's burst between 1.3 and 1.0 (off); every other run between two timings of 1.0 (on)
    anchors = iter([1.0, 1.0, 1.3, 1.0, 1.0, 1.0, 1.0])
    monkeypatch.setattr(sf, "profile_anchor", lambda base, profile, where: (lambda: next(anchors), 1.0))
    made = {"burst": 0, "poisson_50": 0}

    def fake_run(cfg, out_dir=None, verbose=True):
        cell = "burst" if cfg.workload.arrival == "all_at_once" else "poisson_50"
        if cfg.executor.name == "sim":
            return {"throughput_tok_s": 1000.0, "e2e_s_p50": 1.0, "spec_acceptance_rate": 0.6}
        made[cell] += 1
        off = (cell, made[cell]) in (("poisson_50", 1), ("burst", 2))
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / sf.TRACE_FILE).write_text("same trace\n")
        # runs off speed are slow: judged, they would move the median
        return {"throughput_tok_s": 500.0 if off else 1000.0, "e2e_s_p50": 2.0 if off else 1.0,
                "spec_acceptance_rate": 0.6, "throughput_req_s": 10.0}  # fmt: skip

    import cbjax.app.run

    monkeypatch.setattr(cbjax.app.run, "run_single", fake_run)
    profile = tmp_path / "profile.json"
    profile.write_text(json.dumps({**SCRIPT_PROFILE, "steps": [{"kind": "verify", "rows": 1, "tokens": 4}],
                                   "gaps": [[1, 1e-4]]}))  # fmt: skip
    sf.main(["--profile", str(profile), "--runs", "2", "--out", str(tmp_path / "out")])
    report = json.loads((tmp_path / "out" / "spec_fidelity.json").read_text())
    for cell in ("burst", "poisson_50"):
        judged = report["cells"][cell]["judged"]
        # three runs made (one off speed), two judged: all at 1000 tok/s, the simulator exact
        assert (judged["runs"], judged["runs_made"]) == (2, 3)
        assert judged["throughput_tok_s"]["engine_median"] == 1000.0 and judged["throughput_tok_s"]["pass"] is True
        assert judged["all_runs"]["throughput_tok_s"]["engine_median"] == 1000.0  # median of 1000, 1000, 500
        assert judged["all_runs"]["e2e_s_p50"]["engine_range"] == [1.0, 2.0]
        assert [e["on_speed"] for e in report["cells"][cell]["engine"]] == ([True, False, True] if cell == "burst"
                                                                            else [False, True, True])  # fmt: skip
    assert "smoke run" in capsys.readouterr().out  # fewer than 5 judged runs
