"""experiments/tier_fidelity.py by hand: a figure's verdict, and which engine runs are judged (those
made at the profile's machine speed, by its latency or burst anchor), with the engine and
simulator faked."""

import json
import sys

import pytest

from conftest import REPO, SCRIPT_PROFILE
from cbjax.profile.latency import MIN_REFERENCE

sys.path.insert(0, str(REPO / "experiments"))
import tier_fidelity as tf  # noqa: E402

PROFILE = {**SCRIPT_PROFILE, "coefficients": dict.fromkeys(
    ("swap_out_iter_s", "swap_out_page_s", "swap_in_iter_s", "swap_in_page_s"), 1e-4)}


def fake_cells(monkeypatch, slow):
    """Fake engine runs of both cells, the `slow` (pause distribution, nth run) ones at twice the
    TTFT and half the throughput (judged, they would move the medians); the simulator at the
    others'."""
    made = {"exponential": 0, "pareto": 0}

    def fake_run(cfg, out_dir=None, verbose=True):
        if cfg.executor.name == "sim":
            return {"ttft_s_p50": 0.010, "throughput_tok_s": 200.0}
        dist = cfg.workload.pause.dist
        made[dist] += 1
        off = (dist, made[dist]) in slow
        return {"ttft_s_p50": 0.020 if off else 0.010, "throughput_tok_s": 100.0 if off else 200.0}

    monkeypatch.setattr(tf, "run_single", fake_run)


def test_verdict_by_hand():
    runs = [{"ttft_s_p50": t, "throughput_tok_s": 100.0} for t in (0.010, 0.012, 0.011)]
    v = tf.judge({"ttft_s_p50": 0.0099, "throughput_tok_s": 106.0}, runs)
    # TTFT: median 0.011, 0.0099 is -10% (at the target: passes); throughput +6% fails 5%
    assert v["ttft_s_p50"]["engine_median"] == 0.011 and v["ttft_s_p50"]["engine_range"] == [0.010, 0.012]
    assert v["ttft_s_p50"]["error_pct"] == pytest.approx(-10.0) and v["ttft_s_p50"]["pass"] is True
    assert v["throughput_tok_s"]["error_pct"] == pytest.approx(6.0) and v["throughput_tok_s"]["pass"] is False
    # no engine run: every figure fails, nothing to compare
    assert tf.judge({"ttft_s_p50": 0.01, "throughput_tok_s": 1.0}, [])["ttft_s_p50"]["pass"] is False


def test_only_runs_at_the_profiles_speed_are_judged(tmp_path, monkeypatch, capsys):
    # anchors (reference 1.0) before the first run and after each, rounds over the two cells:
    # round 1's tool-call run sits between 1.0 and 1.2 (off speed), round 2's think-time run
    # between 1.2 and 1.0 (off); each cell then needs a third run, both on speed
    anchors = iter([1.0, 1.0, 1.2, 1.0, 1.0, 1.0, 1.0])
    monkeypatch.setattr(tf, "profile_anchor", lambda base, profile, where: (lambda: next(anchors), 1.0))
    fake_cells(monkeypatch, slow={("pareto", 1), ("exponential", 2)})
    profile = tmp_path / "profile.json"
    profile.write_text(json.dumps(PROFILE))
    out = tmp_path / "tier.json"
    tf.main(["--profile", str(profile), "--runs", "2", "--out", str(out)])
    report = json.loads(out.read_text())
    assert report["anchor"] == "burst"  # the profile keeps no lone requests
    for name, cell in report["cells"].items():
        on = [e["on_speed"] for e in cell["engine"]]
        assert on == ([True, False, True] if "exponential" in name else [False, True, True])
        assert cell["runs_judged"] == 2
        assert cell["verdict"]["ttft_s_p50"]["engine_range"] == [0.010, 0.010] and cell["verdict"]["ttft_s_p50"]["pass"]
        assert cell["all_runs"]["ttft_s_p50"]["engine_range"] == [0.010, 0.020]  # reported, not judged
    assert "smoke run" in capsys.readouterr().out


def test_the_note_says_how_the_profile_priced_the_tier_s_copies():
    from cbjax.profile.copies import MIN_SERVED_COPIES

    terms = dict.fromkeys(("swap_out_iter_s", "swap_out_page_s", "swap_in_iter_s", "swap_in_page_s"), 1e-4)
    served = [{"stores": 1, "loads": 2, "measured_s": 3e-4 + i * 1e-6} for i in range(MIN_SERVED_COPIES)]
    assert "timed while serving" in tf.copy_terms_note({"coefficients": terms, "served_copies": served})
    assert "timed alone" in tf.copy_terms_note({"coefficients": terms, "served_copies": served[:1]})
    assert "timed alone" in tf.copy_terms_note({"coefficients": terms})
    assert "shared swap terms" in tf.copy_terms_note({"coefficients": {"swap_iter_s": 1e-4, "swap_page_s": 1e-6}})


LONE_PROFILE = {**PROFILE, "served_wake": {"settings": {}, "requests": [
    {"pass": 0, "prompt_len": 16, "arrival_s": 0.0, "ttft_s": 0.002, "idle_s": 0.02}] * MIN_REFERENCE}}


def test_cells_are_judged_by_the_latency_anchor_by_default(tmp_path, monkeypatch, capsys):
    # the latency anchor (reference 1) before the first run and after each: round 2's runs (the
    # slow ones) sit between 1.0 and 1.3 and 1.3 and 1.0; the burst anchor is never asked
    speeds = iter([1.0, 1.0, 1.0, 1.3, 1.0, 1.0, 1.0])
    seen = {}

    def timer(cfg, reference):
        seen["reference"] = reference
        return lambda: next(speeds)

    monkeypatch.setattr(tf, "lone_timer", timer)
    monkeypatch.setattr(tf, "profile_anchor", lambda *a: pytest.fail("the burst anchor judged a latency cell"))
    fake_cells(monkeypatch, slow={("exponential", 2), ("pareto", 2)})
    profile = tmp_path / "profile.json"
    profile.write_text(json.dumps(LONE_PROFILE))
    out = tmp_path / "tier.json"
    tf.main(["--profile", str(profile), "--runs", "2", "--out", str(out)])
    assert seen["reference"] == {16: 0.002}
    assert "judged by the latency anchor" in capsys.readouterr().out
    report = json.loads(out.read_text())
    assert report["anchor"] == "lone"
    for cell in report["cells"].values():
        assert [e["on_speed"] for e in cell["engine"]] == [True, False, True]
        assert cell["verdict"]["ttft_s_p50"]["engine_range"] == [0.010, 0.010] and cell["verdict"]["ttft_s_p50"]["pass"]


def test_the_burst_anchor_judges_when_asked_or_without_lone_requests(tmp_path, monkeypatch, capsys):
    calls = []
    monkeypatch.setattr(tf, "lone_timer", lambda *a: pytest.fail("the latency anchor was built"))
    monkeypatch.setattr(tf, "profile_anchor", lambda base, profile, where: (calls.append(where), (None, None))[1])
    fake_cells(monkeypatch, slow=set())
    with_lone, without = tmp_path / "with.json", tmp_path / "without.json"
    with_lone.write_text(json.dumps(LONE_PROFILE))
    without.write_text(json.dumps(PROFILE))
    tf.main(["--profile", str(with_lone), "--runs", "1", "--anchor", "burst", "--out", str(tmp_path / "a.json")])
    tf.main(["--profile", str(without), "--runs", "1", "--out", str(tmp_path / "b.json")])
    assert calls == [str(with_lone), str(without)]
    assert "runs judged by the burst anchor" in capsys.readouterr().out
    # a profile without an anchor of either kind: every run judged, and the report says so
    assert json.loads((tmp_path / "b.json").read_text())["anchor"] is None
