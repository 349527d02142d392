"""experiments/steadiness.py: the summary of per-run step times, checked by hand."""

from __future__ import annotations

import sys

import pytest

from conftest import REPO

sys.path.insert(0, str(REPO / "experiments"))
import steadiness  # noqa: E402


def test_the_summary_of_runs_medians():
    # median of 9.9, 10.0, 10.2, 12.0 is 10.1; 12.0 is 18.8% off it, 9.9 is 2.0% off, 10.0 and 10.2 1.0%
    got = steadiness.steadiness([10.0, 12.0, 10.2, 9.9])
    assert got["runs"] == 4 and got["median_s"] == pytest.approx(10.1)
    assert got["fastest_s"] == 9.9 and got["slowest_s"] == 12.0
    assert got["spread"] == pytest.approx(12.0 / 9.9 - 1.0)
    assert got["near_median"] == 3
    assert steadiness.steadiness([10.0, 12.0, 10.2, 9.9], near=0.015)["near_median"] == 2  # 9.9 falls out


def test_no_runs_is_an_error_and_too_few_runs_name_the_option(capsys):
    with pytest.raises(ValueError, match="medians"):
        steadiness.steadiness([])
    with pytest.raises(SystemExit):
        steadiness.main(["--runs", "1"])
    assert "--runs" in capsys.readouterr().err
