"""The calibration's acceptance rule by hand: the bootstrap interval of the median, the verdict
(the target's alone, never a spread), the per-regime summary and experiments/calibrate.py's report."""

import argparse
import json
import sys

import numpy as np
import pytest

from conftest import REPO
from cbjax.profile.acceptance import bootstrap_median_interval, judge, signed_error_pct, summarize_regimes

sys.path.insert(0, str(REPO / "experiments"))
import calibrate  # noqa: E402


def test_bootstrap_interval_of_the_median_by_hand():
    # 7 runs 1..7: a resample's median is <= 1 with P(>= 4 of 7 draws are 1) = 0.0085 < 0.05,
    # <= 2 with P(>= 4 of 7 draws <= 2) = 0.108 >= 0.05, so the 5% quantile is 2; by symmetry 95% is 6
    assert bootstrap_median_interval([1, 2, 3, 4, 5, 6, 7]) == (2.0, 6.0)
    assert bootstrap_median_interval([7, 1, 6, 2, 5, 3, 4], seed=3) == (2.0, 6.0)  # order and seed do not matter here
    assert bootstrap_median_interval([5.0] * 5) == (5.0, 5.0)
    # seeded: the same call gives the same interval
    noisy = [0.9, 1.3, 1.0, 1.1, 2.0, 0.95]
    assert bootstrap_median_interval(noisy, seed=1) == bootstrap_median_interval(noisy, seed=1)
    with pytest.raises(ValueError, match="non-empty"):
        bootstrap_median_interval([])


def test_verdict_is_the_targets_and_the_interval_never_passes_a_cell():
    # engine 100, 101, 102, 103, 104: median 102; the simulator 112.2 is +10%
    runs = [100, 101, 102, 103, 104]
    j = judge(112.2, runs, target_pct=15.0)
    assert j["engine"] == 102 and j["error_pct"] == pytest.approx(10.0)
    assert (j["in_interval"], j["within_target"], j["verdict"]) == (False, True, "pass")
    assert judge(112.2, runs, target_pct=5.0)["verdict"] == "fail"
    # a noisy engine (60 .. 140) holds the simulator inside its interval, yet a 16% error still fails 10%
    noisy = judge(116.0, [60, 80, 100, 120, 140], target_pct=10.0)
    assert noisy["in_interval"] and noisy["error_pct"] == pytest.approx(16.0) and noisy["verdict"] == "fail"
    # without a target: reported, not judged
    assert judge(90.0, runs, target_pct=None)["verdict"] == "-"
    assert signed_error_pct(90.0, 100.0) == pytest.approx(-10.0)
    # a numpy simulator figure still gives plain bools: the verdicts go to JSON
    j = judge(np.float64(101.0), runs, target_pct=5.0)
    assert type(j["in_interval"]) is bool and type(j["within_target"]) is bool
    json.dumps(j)


def _cell(name, regime, errors):
    out = {"name": name, "regime": regime}
    for fig, err in errors.items():
        out[fig] = judge(100.0 * (1 + err / 100.0), [100.0] * 5, calibrate.TARGETS.get(fig))
    return out


def test_regime_summary_by_hand_shows_a_bias_a_pooled_median_hides():
    cells = [
        _cell("a", "light", {"e2e_s_p50": 8.0}),
        _cell("b", "light", {"e2e_s_p50": 6.0}),
        _cell("c", "burst", {"throughput_tok_s": -2.0}),
        _cell("d", "heavy", {"e2e_s_p50": -7.0}),
        _cell("e", "heavy", {"e2e_s_p50": 1.0}),
    ]
    rows = {(r["regime"], r["figure"]): r for r in summarize_regimes(cells, ["throughput_tok_s", "e2e_s_p50"])}
    assert list(rows) == [("burst", "throughput_tok_s"), ("light", "e2e_s_p50"), ("heavy", "e2e_s_p50")]
    light = rows[("light", "e2e_s_p50")]
    # both light cells pass 10%, but the regime over-predicts by 7% on average: > 5%
    assert light["mean_signed_error_pct"] == pytest.approx(7.0) and light["num_pass"] == 2 and not light["bias_ok"]
    heavy = rows[("heavy", "e2e_s_p50")]
    assert heavy["mean_signed_error_pct"] == pytest.approx(-3.0) and heavy["bias_ok"]
    assert (heavy["worst_cell"], heavy["worst_error_pct"]) == ("d", pytest.approx(-7.0))
    assert rows[("burst", "throughput_tok_s")]["num_targeted"] == 1


def _run(value):
    return {k: value for k, _ in calibrate.METRICS}


def test_closed_loop_cells_carry_throughput_open_loop_cells_latencies():
    burst = calibrate.judge_cell("burst", "fcfs", False, _run(1.09), [_run(1.0)] * 5)
    light = calibrate.judge_cell("poisson_30", "static", True, _run(1.09), [_run(1.0)] * 5)
    assert burst["regime"] == "burst" and burst["throughput_tok_s"]["verdict"] == "fail"  # +9% > 5%
    assert all(k not in burst for k, _ in calibrate.OPEN_METRICS)
    assert light["regime"] == "light" and "throughput_tok_s" not in light
    assert light["e2e_s_p99"]["verdict"] == "pass" and light["e2e_s_p50"]["verdict"] == "pass"  # +9% within 10, 15
    assert light["tpot_s_p99"]["verdict"] == "-"


def test_calibration_markdown_by_hand(tmp_path):
    profile = tmp_path / "profile.json"
    profile.write_text(json.dumps({
        "machine": {"cpu": "test cpu", "cores": 2, "jax": "0"}, "residuals": {"median_rel_error": 0.05, "max_rel_error": 0.2},
    }))  # fmt: skip
    runs = [100.0, 101.0, 102.0, 103.0, 104.0]
    cells = [
        {**_cell("burst, fcfs, chunked off", "burst", {}), "throughput_tok_s": judge(107.0, runs, 5.0)},
        {**_cell("burst, static, chunked off", "burst", {}), "throughput_tok_s": judge(102.0, runs, 5.0)},
    ]
    report = {"repeats": 5, "quick": False, "cells": cells,
              "regimes": summarize_regimes(cells, ["throughput_tok_s"]),
              "ratios": calibrate.ratio_rows(
                  [{"workload": "burst", "closed_loop": True}],
                  {("burst", "fcfs", False): 215.0, ("burst", "static", False): 100.0},
                  {("burst", "fcfs", False): [200.0] * 5, ("burst", "static", False): [100.0] * 5})}  # fmt: skip
    doc = tmp_path / "CALIBRATION.md"
    calibrate.write_markdown(report, str(profile), doc)
    text = doc.read_text()
    # 107 against the median 102: +4.9%, outside [100, 104], within 5%; the regime's mean (4.9 + 0) / 2
    assert "| burst, fcfs, chunked off | burst | throughput | 102 [100, 104] | 107 | +4.9 | no | yes (±5) | pass |" in text
    assert "| burst | throughput | 2 | +2.5 | burst, fcfs, chunked off (+4.9) | 2 / 2 | yes |" in text
    # continuous/static: simulator 2.15, engine 2.0: +7.5%, beyond 5%
    assert "| burst | 2.150 | 2.000 | +7.5 | fail |" in text
    assert "no target is ever replaced by the engine's spread" in text
    assert "**Overall:** 2 of 2 judged figures within target; regimes biased beyond ±5%: none." in text


def test_fewer_than_five_repeats_is_refused_without_quick(tmp_path):
    with pytest.raises(SystemExit):
        calibrate.main(["--profile", str(tmp_path / "p.json"), "--repeats", "3"])


def test_default_cells_are_the_acceptance_cells():
    args = argparse.Namespace(quick=False, cells="acceptance", workloads=None, policies=list(calibrate.POLICIES))
    assert calibrate.plan_cells(args) == [("burst", "fcfs", False), ("burst", "static", False),
                                          ("poisson_30", "fcfs", False), ("poisson_60", "fcfs", False)]  # fmt: skip
    args.cells = "all"
    assert len(calibrate.plan_cells(args)) == len(calibrate.WORKLOADS) * 3 * 2


def test_reports_of_two_slot_counts_merge_into_one_by_hand():
    runs = [100.0] * 5

    def report(slots, sim):
        cell = {**_cell("burst, fcfs, chunked off", "burst", {}), "throughput_tok_s": judge(sim, runs, 5.0)}
        return {"slots": slots, "repeats": 5, "quick": False, "cells": [cell], "ratios": [{"workload": "burst"}]}

    merged = calibrate.merge_reports([report(16, 104.0), report(32, 90.0)])
    assert [c["name"] for c in merged["cells"]] == ["16 slots: burst, fcfs, chunked off", "32 slots: burst, fcfs, chunked off"]
    assert [r["workload"] for r in merged["ratios"]] == ["burst (16 slots)", "burst (32 slots)"]
    # the regime's mean over both slot counts: (+4 - 10) / 2 = -3%, worst the 32 slots' -10%
    (row,) = merged["regimes"]
    assert row["mean_signed_error_pct"] == pytest.approx(-3.0) and row["worst_cell"].startswith("32 slots")


def test_regeneration_keeps_the_hand_kept_guide_before_the_tables(tmp_path):
    profile = tmp_path / "profile.json"
    profile.write_text(json.dumps({
        "machine": {"cpu": "test cpu", "cores": 2, "jax": "0"}, "residuals": {"median_rel_error": 0.05, "max_rel_error": 0.2},
    }))  # fmt: skip
    doc = tmp_path / "CALIBRATION.md"
    head = "# Calibration\n\nguide by hand\n\n## The current tables\n\nrun on a date, by a command, at a commit\n\n"
    doc.write_text(head + "Profile: `old` (old)\n\n## Cells\n\nold table\n")
    report = {"repeats": 5, "quick": False, "cells": [], "regimes": [], "ratios": []}
    calibrate.write_markdown(report, str(profile), doc)
    text = doc.read_text()
    assert text.startswith(head + f"Profile: `{profile}`")
    assert "old table" not in text and "Profile: `old`" not in text
    # a new document gets the generated title
    fresh = tmp_path / "new.md"
    calibrate.write_markdown(report, str(profile), fresh)
    assert fresh.read_text().startswith("# Calibration: the profiled simulator against the JAX engine\n\nProfile: `")


def _timer(timings):
    it = iter(timings)
    return lambda: next(it)


def _engine(key, cfg, r, done, total):
    return {"key": key, "round": r}


def test_runs_off_the_profiles_speed_are_counted_not_judged_and_rounds_go_on():
    # anchors (reference 1.0): before a's 1st run 1.0, then after each run in turn; b's first run
    # lies between 1.0 and 1.2 (off: 1.2 is 20% slow), a's second between 1.2 and 1.0 (off)
    anchors = [1.0, 1.0, 1.2, 1.0, 1.03, 0.98, 1.0]
    runs = calibrate.engine_rounds({"a": None, "b": None}, 2, _engine, _timer(anchors), 1.0)
    assert [(e["round"], e["on_speed"]) for e in runs["a"]] == [(0, True), (1, False), (2, True)]
    assert [(e["round"], e["on_speed"]) for e in runs["b"]] == [(0, False), (1, True), (2, True)]
    assert runs["b"][0]["anchor_speed"] == pytest.approx(1.1) and runs["a"][2]["anchor_speed"] == pytest.approx(1.005)


def test_a_cell_never_on_speed_stops_at_the_round_cap_and_fails():
    runs = calibrate.engine_rounds({"a": None}, 2, _engine, lambda: 1.5, 1.0, max_rounds=4)
    assert len(runs["a"]) == 4 and not any(e["on_speed"] for e in runs["a"])
    # 2 runs at the profile's speed of 5 wanted: a +1% figure still fails; with 5 it passes
    short = calibrate.judge_cell("burst", "fcfs", False, _run(1.01), [_run(1.0)] * 2, repeats=5, runs=9)
    full = calibrate.judge_cell("burst", "fcfs", False, _run(1.01), [_run(1.0)] * 5, repeats=5, runs=9)
    assert short["throughput_tok_s"]["verdict"] == "fail" and short["throughput_tok_s"]["within_target"] is False
    assert full["throughput_tok_s"]["verdict"] == "pass" and (full["runs_judged"], full["runs"]) == (5, 9)


def test_rounds_give_up_once_the_machine_moved_off_the_profiles_speed():
    # on speed for a's and b's first runs, then 1.2 from the 3rd anchor on: after b's second run
    # the last 3 runs' speeds (1.0, 1.1, 1.2) have a median 10% off: the rounds stop there
    anchors = [1.0, 1.0, 1.0, 1.2, 1.2, 1.2, 1.2, 1.2, 1.2]
    runs = calibrate.engine_rounds({"a": None, "b": None}, 5, _engine, _timer(anchors), 1.0, give_up_after=3)
    assert [e["on_speed"] for e in runs["a"]] == [True, False]
    assert [e["on_speed"] for e in runs["b"]] == [True, False]
    # timings scattered around the profile's speed: 5 runs off in a row (one timing 6-7% off
    # each), but their median speed within 1.035: the rounds go on to 5 runs on speed
    scattered = [1.0, 1.07, 0.94, 1.07, 0.94] + [1.0] * 10
    runs = calibrate.engine_rounds({"a": None}, 5, _engine, _timer(scattered), 1.0, give_up_after=3)
    assert [e["on_speed"] for e in runs["a"]] == [False] * 5 + [True] * 5


def test_moved_by_hand():
    assert calibrate.moved([1.0, 1.1, 1.06, 1.07], 3) and calibrate.moved([0.9, 0.94, 0.96], 3)
    assert not calibrate.moved([1.1, 1.1, 1.0, 1.04, 1.2], 3)  # median 1.04
    assert not calibrate.moved([1.2, 1.2], 3) and not calibrate.moved([1.2] * 5, None)  # too few; never


def test_without_an_anchor_every_run_counts_and_repeats_bound_the_rounds():
    runs = calibrate.engine_rounds({"a": None, "b": None}, 3, _engine, None, None)
    assert [len(v) for v in runs.values()] == [3, 3]
    assert all(e["on_speed"] and e["anchor_speed"] is None for v in runs.values() for e in v)


def test_a_cell_with_no_run_at_the_profiles_speed_is_listed_and_fails(tmp_path):
    # 16 slots: every run off speed (none judged of 15); 32 slots: measured, +2%
    none = calibrate.judge_cell("burst", "fcfs", False, _run(1.0), [], repeats=5, runs=15)
    ok = calibrate.judge_cell("burst", "fcfs", False, _run(1.02), [_run(1.0)] * 5, repeats=5, runs=5)
    assert none["throughput_tok_s"]["verdict"] == "fail" and none["throughput_tok_s"]["engine"] is None
    report = calibrate.merge_reports([
        {"slots": 16, "repeats": 5, "quick": False, "cells": [none], "ratios": []},
        {"slots": 32, "repeats": 5, "quick": False, "cells": [ok], "ratios": []},
    ])  # fmt: skip
    (row,) = report["regimes"]
    # the regime's mean is the measured cell's alone, but it is not shown unbiased, and 1 of 2 pass
    assert row["mean_signed_error_pct"] == pytest.approx(2.0) and not row["bias_ok"]
    assert (row["num_pass"], row["num_targeted"]) == (1, 2)
    profile = tmp_path / "profile.json"
    profile.write_text(json.dumps({
        "machine": {"cpu": "test cpu", "cores": 2, "jax": "0"}, "residuals": {"median_rel_error": 0.05, "max_rel_error": 0.2},
    }))  # fmt: skip
    doc = tmp_path / "CALIBRATION.md"
    calibrate.write_markdown(report, str(profile), doc)
    text = doc.read_text()
    assert "| 16 slots: burst, fcfs, chunked off | burst | throughput | no run at the profile's speed | 1 | - | no | no (±5) | fail |" in text
    assert "**Overall:** 1 of 2 judged figures within target" in text
    # no ratio without the engine's runs of both policies
    rows = calibrate.ratio_rows([{"workload": "burst", "closed_loop": True}],
                                {("burst", "fcfs", False): 2.0, ("burst", "static", False): 1.0},
                                {("burst", "fcfs", False): [], ("burst", "static", False): [1.0]})  # fmt: skip
    assert rows == [{"workload": "burst", "sim": 2.0, "engine": None, "error_pct": None, "verdict": "fail"}]


def test_reports_calibrated_apart_merge_into_one_document(tmp_path):
    profiles, reports = [], []
    for slots, sim in ((16, 104.0), (32, 90.0)):
        profile = tmp_path / f"p{slots}.json"
        profile.write_text(json.dumps({
            "machine": {"cpu": "test cpu", "cores": 2, "jax": "0"}, "residuals": {"median_rel_error": 0.05, "max_rel_error": 0.2},
        }))  # fmt: skip
        cell = {**_cell("burst, fcfs, chunked off", "burst", {}), "throughput_tok_s": judge(sim, [100.0] * 5, 5.0)}
        report = tmp_path / f"r{slots}.json"
        report.write_text(json.dumps({"slots": slots, "repeats": 5, "quick": False, "cells": [cell], "ratios": []}))
        profiles.append(str(profile))
        reports.append(str(report))
    doc = tmp_path / "CALIBRATION.md"
    args = ["--profile", *profiles, "--out-dir", str(tmp_path / "out"), "--doc", str(doc)]
    calibrate.main([*args, "--reports", *reports])
    text = doc.read_text()
    assert "| 16 slots: burst, fcfs, chunked off | burst | throughput | 100 [100, 100] | 104 | +4.0 |" in text
    assert "| 32 slots: burst, fcfs, chunked off | burst | throughput | 100 [100, 100] | 90 | -10.0 |" in text
    assert "**Overall:** 1 of 2 judged figures within target" in text
    with pytest.raises(SystemExit):
        calibrate.main([*args, "--reports", reports[0]])


class _CutShort:
    """A text file whose first write stops halfway with a Ctrl-C."""

    def __init__(self, f):
        self.f = f

    def write(self, text):
        self.f.write(text[: len(text) // 2])
        self.f.flush()
        raise KeyboardInterrupt

    def __getattr__(self, name):
        return getattr(self.f, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.f.close()


def test_a_regeneration_cut_short_keeps_the_whole_old_document(tmp_path, monkeypatch):
    import builtins
    import io

    profile = tmp_path / "profile.json"
    profile.write_text(json.dumps({"machine": {"cpu": "c", "cores": 2, "jax": "0"},
                                   "residuals": {"median_rel_error": 0.05, "max_rel_error": 0.2}}))
    doc = tmp_path / "CALIBRATION.md"
    old = "# Calibration\n\nguide by hand\n\n" + "Profile: `old` (old)\n\n## Cells\n\nold table\n" * 50
    doc.write_text(old)
    report = {"repeats": 5, "quick": False, "cells": [], "regimes": [], "ratios": []}
    real_open = builtins.open

    def cut_short_open(file, mode="r", *args, **kwargs):
        f = real_open(file, mode, *args, **kwargs)
        return _CutShort(f) if "w" in mode and "CALIBRATION.md" in str(file) else f

    monkeypatch.setattr(builtins, "open", cut_short_open)
    monkeypatch.setattr(io, "open", cut_short_open)
    with pytest.raises(KeyboardInterrupt):
        calibrate.write_markdown(report, str(profile), doc)
    monkeypatch.undo()
    assert doc.read_text() == old
    assert sorted(p.name for p in tmp_path.iterdir()) == ["CALIBRATION.md", "profile.json"]  # no temporary left
