"""experiments/fidelity_table.py: one table of a fidelity run, each row against its target,
from result files written here by hand."""

from __future__ import annotations

import json
import sys

import pytest

from conftest import REPO

sys.path.insert(0, str(REPO / "experiments"))
import fidelity_table  # noqa: E402


def test_every_check_becomes_a_row_with_its_verdict(tmp_path):
    (tmp_path / "profile_tiny_16").mkdir()
    regimes = {"light": {"mean_signed_error": 0.031}, "heavy": {"mean_signed_error": -0.062}}
    (tmp_path / "profile_tiny_16" / "profile.json").write_text(json.dumps(
        {"pinning": {"cores": 1, "cpus": [0]}, "residuals": {"by_regime": {"regimes": regimes}}}))
    (tmp_path / "calibration").mkdir()
    judge = {"error_pct": -4.0, "within_target": True}
    (tmp_path / "calibration" / "calibration.json").write_text(json.dumps({
        "cells": [{"name": "burst, fcfs", "throughput_tok_s": judge, "ttft_s_p50": {"error_pct": 12.5, "within_target": False}}],
        "regimes": [{"regime": "burst", "figure": "throughput_tok_s", "mean_signed_error_pct": -4.0, "bias_ok": True}],
        "ratios": [{"workload": "burst", "error_pct": None, "verdict": "fail"}],
    }))
    (tmp_path / "decisions.log").write_text("7 passed in 3.0s\n")
    (tmp_path / "cluster_ratios.json").write_text(json.dumps({"comparisons": {"pd / colocated": {"figures": {
        "ttft_s_p50": {"error": 0.08, "engine_median": 1.0, "simulator": 1.08, "pass": True}}}},
        "separation": {"median": 1.45}}))
    rows = fidelity_table.rows_of(tmp_path)
    verdicts = {(r[0], r[2]): r[-1] for r in rows}
    assert verdicts[("residual", "light")] == "pass" and verdicts[("residual", "heavy")] == "FAIL"  # 6.2% > 5%
    assert verdicts[("cell", "throughput_tok_s")] == "pass" and verdicts[("cell", "ttft_s_p50")] == "FAIL"
    assert verdicts[("regime mean", "throughput_tok_s")] == "pass"
    assert verdicts[("continuous / static", "throughput ratio")] == "fail"
    assert verdicts[("cluster decisions", "same replica")] == "pass"
    assert verdicts[("cluster ratio", "ttft_s_p50")] == "pass"
    assert verdicts[("cluster separation", "makespan")] == "SHARED"  # 1.45 > 0.75: the cores are shared
    assert len(rows) == 9


def test_replicas_that_finish_split_in_about_half_the_time_read_apart(tmp_path):
    (tmp_path / "cluster_ratios.json").write_text(json.dumps({"comparisons": {}, "separation": {"median": 0.52}}))
    assert fidelity_table.rows_of(tmp_path)[-1][-1] == "apart"


@pytest.mark.parametrize("made", [False, True])
def test_a_folder_with_no_fidelity_run_is_an_error_not_an_empty_table(made, tmp_path, capsys):
    out = tmp_path / "fidelty"  # a typo of the run's folder, or a run that wrote nothing yet
    if made:
        out.mkdir()
    with pytest.raises(SystemExit) as stop:
        fidelity_table.main([str(out)])
    assert stop.value.code == 2
    captured = capsys.readouterr()
    assert "rows" not in captured.out
    why = "no such folder" if not made else "holds none of a fidelity run's files"
    assert f"error: out: {out}: {why}" in captured.err.strip().splitlines()[-1]
