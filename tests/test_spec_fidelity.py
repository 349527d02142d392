"""experiments/spec_fidelity.py's pure parts by hand: the half-capacity rate, the figure's verdict,
the table's cells, which runs share a simulation, and what a profile lacks for speculation."""

import math
import sys

import pytest

from conftest import REPO

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
