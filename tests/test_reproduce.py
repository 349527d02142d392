"""experiments/reproduce.py end to end, and cut-down ltr_toy, vtc_overload and static_vs_continuous."""

import json
import sys

import pytest

from conftest import REPO
from test_cli import composed
from cbjax.app.run import run_experiment

sys.path.insert(0, str(REPO / "experiments"))
import reproduce  # noqa: E402


def _rows(out_dir):
    return {r["setting"]: r for r in json.loads((out_dir / "reproduction.json").read_text())}


def test_ltr_toy_is_exact(tmp_path):
    summaries = run_experiment(composed("experiment=ltr_toy", "progress=false"), tmp_path, verbose=False)
    # hand computation in the config's notes: FCFS (10/10 + 12/2 + 13/1) / 3, SJF (1/1 + 3/2 + 13/10) / 3
    assert summaries["fcfs"]["normalized_latency_s_per_token"] == pytest.approx(20 / 3)
    assert summaries["sjf"]["normalized_latency_s_per_token"] == pytest.approx(3.8 / 3)
    rows = _rows(tmp_path)
    assert {k: (r["paper"], r["verdict"]) for k, r in rows.items()} == {"FCFS": (6.67, "pass"), "SJF": (1.27, "pass")}


def test_vtc_overload_cut_down_keeps_the_shape(tmp_path):
    # 40 s of arrivals instead of 360, service measured over them
    cfg = composed("experiment=vtc_overload", "progress=false", "workload.duration_s=40", "metrics.window_s=[0,40]")
    summaries = run_experiment(cfg, tmp_path, verbose=False)
    fcfs, vtc = summaries["fcfs"]["client_service"], summaries["vtc"]["client_service"]
    assert fcfs["client2"] / fcfs["client1"] == pytest.approx(2.0, rel=0.15)  # arrival order: 1:2
    assert vtc["client2"] / vtc["client1"] == pytest.approx(1.0, rel=0.15)  # fair share: 1:1
    assert summaries["vtc"]["window_s"] == [0.0, 40.0]
    assert summaries["fcfs"]["preemptions"] == 0  # reserve_oracle admits only what fits
    assert len(_rows(tmp_path)) == 6
    header = (tmp_path / "vtc" / "client_service.csv").read_text().splitlines()[0]
    assert header == "t_start_s,t_end_s,client_id,prompt_tokens,output_tokens,service,service_per_s"


def test_static_vs_continuous_reports_its_ratio(tmp_path):
    cfg = composed("experiment=static_vs_continuous", "progress=false", "workload.num_requests=200")
    summaries = run_experiment(cfg, tmp_path, verbose=False)
    (row,) = _rows(tmp_path).values()
    ratio = summaries["continuous"]["throughput_tok_s"] / summaries["static"]["throughput_tok_s"]
    assert row["ours"] == pytest.approx(ratio) and ratio > 2


def test_reproduce_script_writes_the_doc_and_plots(tmp_path, capsys):
    assert {"ltr_toy", "vtc_overload", "static_vs_continuous"} <= set(reproduce.discover())
    docs = tmp_path / "docs"
    assert reproduce.main(["--only", "ltr_toy", "--out", str(tmp_path / "out"), "--docs", str(docs)]) == 0
    text = (docs / "REPRODUCTIONS.md").read_text()
    assert "## ltr_toy" in text and "| LTR Fig 1 | FCFS" in text and "20/3 = 6.67" in text
    assert (docs / "reproductions" / "ltr_toy__ltr_fig_1.png").read_bytes()[:4] == b"\x89PNG"
    assert "[1/1] ltr_toy: 2/2 pass at every seed, 0 fragile" in capsys.readouterr().out
    record = json.loads((docs / "reproductions" / "ltr_toy.json").read_text())
    assert record["seeds"] == [0, 1, 2]
    # the toy is deterministic: the same figure at every seed, nothing fitted, nothing fragile
    fcfs = record["rows"][0]
    assert fcfs["seeds"] == {s: {"ours": pytest.approx(20 / 3), "verdict": "pass"} for s in ("0", "1", "2")}
    assert (fcfs["passes"], fcfs["fit"], fcfs["fragile"], fcfs["seed_spread"]) == (3, False, False, 0.0)
    assert "Held out: 2 of 2 rows pass at every seed. Fitted: 0 of 0" in text
    assert (tmp_path / "out" / "ltr_toy" / "seed2" / "reproduction.json").is_file()
    with pytest.raises(SystemExit):
        reproduce.main(["--only", "no_such", "--docs", str(docs)])
    with pytest.raises(SystemExit):  # fewer than 3 seeds
        reproduce.main(["--only", "ltr_toy", "--seeds", "0", "1", "--docs", str(docs)])


def test_fit_flags_and_seed_spread_by_hand():
    from cbjax.report.reproduction import fit_flags, seed_spread

    entries = [{"setting": "a"}, {"setting": "b, with the knob"}, {"setting": "c"}]
    assert fit_flags(entries, ["b, with the knob"]) == [False, True, False]
    assert fit_flags(entries, []) == [False, False, False]
    with pytest.raises(ValueError, match=r"experiment\.fit_rows\[0\]: 'd' names no row"):
        fit_flags(entries, ["d"])
    with pytest.raises(ValueError, match="names 2 rows"):
        fit_flags([{"setting": "a"}, {"setting": "a"}], ["a"])
    # 0.857, 0.71, 0.80: (0.857 - 0.71) / 0.80 = 18.4% (vLLM Fig 2's share over seeds)
    assert seed_spread([0.857, 0.71, 0.80]) == pytest.approx(0.147 / 0.80)
    assert seed_spread([2.0, 2.0, 2.0]) == 0.0 and seed_spread([1.0, None, 1.0]) is None


@pytest.mark.parametrize("name", reproduce.discover())
def test_every_reproduction_declares_its_fit_rows_and_they_name_rows(name):
    import yaml

    from cbjax.report.reproduction import fit_flags

    raw = yaml.safe_load((REPO / "configs" / "experiment" / f"{name}.yaml").read_text())
    assert "fit_rows" in raw["experiment"], f"{name}: declare experiment.fit_rows (an empty list if none)"
    cfg = reproduce.compose(name, [])
    flags = fit_flags(cfg.experiment.reproduction, cfg.experiment.fit_rows)
    # a row whose setting names a modelling-difference knob was fitted on; the others not
    assert flags == [", with the modelling-difference knob" in e["setting"] for e in cfg.experiment.reproduction]


def test_argmin_plot_marks_the_papers_set_by_name():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.colors import to_hex

    import plot_reproductions

    # vLLM Fig 18b's row: `paper` is the text "16-32", which names no arm; p1 is not p16
    row = {"kind": "argmin_in", "setting": "best page size", "metric": "normalized_latency_s_per_token",
           "verdict": "fail", "paper": "16-32", "paper_set": ["p16", "p32"],
           "arm_values": {"p1": 1.0, "p16": 2.0, "p32": 3.0, "p64": 4.0}}  # fmt: skip
    fig, ax = plt.subplots()
    plot_reproductions._arms(ax, row)
    colors = [to_hex(p.get_facecolor()) for p in ax.patches]
    plt.close(fig)
    green, blue = to_hex("tab:green"), to_hex("tab:blue")
    assert colors == [blue, green, green, blue]


def test_run_one_records_the_papers_set_for_the_plot(tmp_path, monkeypatch):
    import cbjax.app.run

    def fake_run(cfg, out_dir, verbose=False):  # no arm runs: only the record's fields matter
        return {arm: {"ttft_s_p50": 1.0, "tbt_s_p99": 1.0} for arm in cfg.experiment.arms}

    monkeypatch.setattr(cbjax.app.run, "run_experiment", fake_run)
    record = reproduce.run_one("sarathi_ablation", tmp_path, [], progress=False)
    argmin = [r for r in record["rows"] if r["kind"] == "argmin_in"]
    assert [r["paper_set"] for r in argmin] == [["both"], ["both"]]
    assert all("paper_set" not in r for r in record["rows"] if r["kind"] != "argmin_in")


def test_setup_text_names_sessions_and_the_trace_speed():
    # multiturn_kv_tier: 300 conversations starting at 0.25 per second, not num_requests' default
    multiturn = reproduce.compose("multiturn_kv_tier", [])
    assert reproduce._workload(multiturn.workload) == "300 sessions, poisson at 0.25 sessions/s"
    assert "workload: 300 sessions, poisson at 0.25 sessions/s." in reproduce.setup_text("multiturn_kv_tier", multiturn)
    # splitwise_hetero: the Azure code trace replayed 3x faster (time_scale 3.0)
    splitwise = reproduce.compose("splitwise_hetero", [])
    assert reproduce._workload(splitwise.workload).endswith(", replayed 3x faster")


def test_record_names_its_overrides_and_commit(tmp_path, monkeypatch):
    import subprocess

    import cbjax.app.run

    def fake_run(cfg, out_dir, verbose=False):  # no arm runs: only the record's fields matter
        return {arm: {"normalized_latency_s_per_token": 1.0} for arm in cfg.experiment.arms}

    monkeypatch.setattr(cbjax.app.run, "run_experiment", fake_run)
    record = reproduce.run_one("ltr_toy", tmp_path, ["workload.num_requests=3"], progress=False, commit="abc123")
    assert record["command"] == "cbjax experiment=ltr_toy workload.num_requests=3"
    assert record["commit"] == "abc123"
    text = reproduce.render([record], tmp_path / "docs")
    assert "`cbjax experiment=ltr_toy workload.num_requests=3` at commit abc123" in text
    head = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True)
    if head.returncode == 0:  # a git checkout: its HEAD, marked dirty or not
        assert reproduce.git_commit().split("-")[0] == head.stdout.strip()
    assert reproduce.git_commit(tmp_path) is None  # not a checkout
