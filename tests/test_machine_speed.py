"""benchmarks/machine_speed.py: the clusters and stays it reports, on hand-made slice times."""

from __future__ import annotations

import sys

import numpy as np

from conftest import REPO

sys.path.insert(0, str(REPO / "benchmarks"))
import machine_speed as ms  # noqa: E402


def test_two_speeds_are_split_and_their_stays_counted():
    # 30 fast slices of 10 ms, 20 slow of 16 ms, 10 fast, 40 slow: 3 switches
    times = np.array([0.010] * 30 + [0.016] * 20 + [0.010] * 10 + [0.016] * 40)
    cut = ms.split_modes(times, min_gap=0.15)
    assert 0.010 < cut < 0.016
    slow = times > cut
    assert slow.sum() == 60
    stays = ms.runs(slow, times)
    assert stays["switches"] == 3
    assert np.isclose(stays["longest_fast_s"], 0.30) and np.isclose(stays["longest_slow_s"], 0.64)


def test_one_speed_with_noise_has_no_clusters():
    rng = np.random.default_rng(0)
    assert ms.split_modes(0.010 * (1 + 0.03 * rng.random(500)), min_gap=0.15) is None
    assert ms.split_modes(np.full(100, 0.01), min_gap=0.15) is None
    # a few slow outliers (under 5% of the slices) are not a second speed
    assert ms.split_modes(np.array([0.010] * 97 + [0.030] * 3), min_gap=0.15) is None


def test_measure_reports_a_run():
    r = ms.measure(seconds=0.2, slice_s=0.002, min_gap=0.15)
    assert r["slices"] >= 10 and r["p5_p50_p95_over_fastest"][0] >= 1.0
    assert "speeds" in ms.report(r)
