"""The reproduction evaluator on hand-made summaries, and its startup checks."""

import json

import pytest

from cbjax.config import ExperimentConfig, RunConfig, WorkloadConfig
from cbjax.report.reproduction import check_entries, evaluate, format_rows, write_reproduction
from cbjax.app.run import run_experiment

SUMMARIES = {
    "a": {"tput": 100.0, "lat": 6.666, "client_service": {"x": 437.0, "y": 876.0}, "none": None},
    "b": {"tput": 450.0, "lat": 1.2667, "client_service": {"x": 700.0, "y": 650.0}, "none": None},
    "c": {"tput": 300.0, "lat": 3.0, "client_service": {}, "none": None},
}
KEYS = {arm: set(s) for arm, s in SUMMARIES.items()}


def _verdicts(entries):
    return [(r["ours"], r["verdict"]) for r in evaluate(entries, SUMMARIES)]


def test_value_within_relative_tolerance():
    rows = _verdicts([
        {"metric": "tput", "arm": "a", "paper": 115.0, "tolerance": 0.15},  # |100-115| = 15 <= 17.25
        {"metric": "tput", "arm": "a", "paper": 120.0, "tolerance": 0.15},  # 20 > 18
        {"metric": "tput", "arm": "a", "paper": 87.0},                      # default 15%: 13 <= 13.05
        {"metric": "tput", "arm": "a", "paper": 86.0},                      # 14 > 12.9
    ])  # fmt: skip
    assert rows == [(100.0, "pass"), (100.0, "fail"), (100.0, "pass"), (100.0, "fail")]


def test_ratio_to_divides_by_the_other_arm():
    rows = evaluate([{"metric": "tput", "arm": "b", "ratio_to": "a", "paper": 5.0, "tolerance": 0.1}], SUMMARIES)
    assert rows[0]["ours"] == 4.5 and rows[0]["verdict"] == "pass"  # |4.5 - 5| = 0.5 <= 0.5
    rows = evaluate([{"metric": "client_service.y", "arm": "a", "ratio_to": "a", "paper": 2.0}], SUMMARIES)
    assert rows[0]["ours"] == 1.0 and rows[0]["verdict"] == "fail"


def test_dotted_metric_reads_nested_fields():
    rows = evaluate([{"metric": "client_service.y", "arm": "a", "paper": 876.0, "tolerance": 0.0}], SUMMARIES)
    assert rows[0]["ours"] == 876.0 and rows[0]["verdict"] == "pass"
    rows = evaluate([{"metric": "client_service.z", "arm": "a", "paper": 1.0}], SUMMARIES)
    assert rows[0]["ours"] is None and rows[0]["verdict"] == "fail"


def test_exact_compares_at_the_papers_printed_precision():
    rows = _verdicts([
        {"kind": "exact", "metric": "lat", "arm": "a", "paper": 6.67},  # 6.666 rounds to 6.67
        {"kind": "exact", "metric": "lat", "arm": "b", "paper": 1.27},  # 1.2667 rounds to 1.27
        {"kind": "exact", "metric": "lat", "arm": "b", "paper": 1.26},
        {"kind": "exact", "metric": "lat", "arm": "a", "paper": 7},     # 6.666 is within 0.5 of 7
        {"kind": "exact", "metric": "lat", "arm": "c", "paper": 3.0},   # "3.0" prints one decimal
        {"kind": "exact", "metric": "lat", "arm": "a", "paper": 6.6},
    ])  # fmt: skip
    assert [v for _, v in rows] == ["pass", "pass", "fail", "pass", "pass", "fail"]


def test_ordering_is_strictly_ascending_in_the_papers_order():
    ok, bad, missing = evaluate([
        {"kind": "ordering", "metric": "tput", "arms": ["a", "c", "b"]},
        {"kind": "ordering", "metric": "tput", "arms": ["a", "b", "c"], "paper": "a < b < c"},
        {"kind": "ordering", "metric": "none", "arms": ["a", "b"]},
    ], SUMMARIES)  # fmt: skip
    assert ok["verdict"] == "pass" and ok["paper"] == "a < c < b"
    assert ok["ours"] == "a (100) < c (300) < b (450)"
    assert bad["verdict"] == "fail" and bad["paper"] == "a < b < c"
    assert missing["verdict"] == "fail" and missing["ours"] is None
    tie = evaluate([{"kind": "ordering", "metric": "tput", "arms": ["a", "a"]}], SUMMARIES)
    assert tie[0]["verdict"] == "fail"  # equal is not ascending


def test_argmin_in_checks_the_lowest_arm():
    rows = evaluate([
        {"kind": "argmin_in", "metric": "lat", "arms": ["a", "b", "c"], "paper_set": ["b", "c"]},
        {"kind": "argmin_in", "metric": "tput", "arms": ["a", "b", "c"], "paper_set": ["b", "c"]},
    ], SUMMARIES)  # fmt: skip
    assert [(r["ours"], r["verdict"]) for r in rows] == [("b (1.267)", "pass"), ("a (100)", "fail")]
    assert rows[0]["paper"] == "lowest in {b, c}"


def test_best_of_holds_an_arm_against_the_lowest_of_the_others():
    rows = evaluate([
        {"kind": "best_of", "metric": "lat", "arm": "c", "arms": ["a", "b"], "tolerance": 1.5},  # 3.0 / 1.2667
        {"kind": "best_of", "metric": "lat", "arm": "c", "arms": ["a", "b"], "tolerance": 1.0},
        {"kind": "best_of", "metric": "lat", "arm": "b", "arms": ["a", "c"]},  # lower than both: passes
        {"kind": "best_of", "metric": "none", "arm": "b", "arms": ["a", "c"]},
    ], SUMMARIES)  # fmt: skip
    assert [r["verdict"] for r in rows] == ["pass", "fail", "pass", "fail"]
    assert rows[0]["ours"] == pytest.approx(3.0 / 1.2667) and rows[2]["tolerance"] == 0.15
    assert rows[0]["paper"] == "c <= the best of {a, b}" and rows[3]["ours"] is None
    with pytest.raises(ValueError, match=r"\[0\]: arms is required for kind best_of"):
        check_entries([{"kind": "best_of", "metric": "lat", "arm": "a"}], KEYS)
    with pytest.raises(ValueError, match=r"\[0\].metric: 'lat' is not a summary.json key of arm 'q'"):
        check_entries([{"kind": "best_of", "metric": "lat", "arm": "a", "arms": ["b", "q"]}], {**KEYS, "q": {"x"}})


def test_rows_have_exactly_the_published_fields(tmp_path):
    rows = evaluate([{"figure": "F1", "setting": "s", "metric": "tput", "arm": "a", "paper": 100}], SUMMARIES)
    path = write_reproduction(tmp_path, rows)
    (row,) = json.loads(path.read_text())
    assert row == {"figure": "F1", "setting": "s", "metric": "tput", "paper": 100, "ours": 100.0,
                   "tolerance": 0.15, "verdict": "pass"}  # fmt: skip
    assert "| F1" in format_rows(rows) and "±15%" in format_rows(rows)


@pytest.mark.parametrize(
    "entry, message",
    [
        ({"metric": "tput", "arm": "a", "paper": 1, "tolerence": 0.1}, r"\[0\]: unknown keys \['tolerence'\]"),
        ({"metric": "tput", "arm": "a", "paper": 1, "kind": "median"}, r"\[0\].kind: unknown value 'median'"),
        ({"metric": "tput", "arm": "zz", "paper": 1}, r"\[0\]: unknown arm 'zz'"),
        ({"metric": "tput", "arm": "a", "ratio_to": "zz", "paper": 1}, r"\[0\]: unknown arm 'zz'"),
        ({"metric": "tputt", "arm": "a", "paper": 1}, r"\[0\].metric: 'tputt' is not a summary.json key of arm 'a'"),
        ({"metric": "tput", "arm": "a"}, r"\[0\]: paper is required for kind value"),
        ({"metric": "tput", "arm": "a", "paper": "fast"}, r"\[0\].paper: must be a number"),
        ({"metric": "tput", "kind": "ordering", "arms": ["a"]}, r"\[0\].arms: an ordering needs at least two"),
        ({"metric": "tput", "kind": "ordering", "arms": ["a", "b"], "arm": "a"}, r"\[0\]: keys \['arm'\] do not apply"),
        ({"metric": "tput", "kind": "argmin_in", "arms": ["a", "b"]}, r"\[0\]: paper_set is required"),
        ({"metric": "tput", "kind": "argmin_in", "arms": ["a"], "paper_set": ["q"]}, r"\[0\]: unknown arm 'q'"),
        ({"metric": "tput", "arm": "a", "paper": 1, "tolerance": -1}, r"\[0\].tolerance: must be a number >= 0"),
    ],
)
def test_bad_entries_fail_naming_the_entry(entry, message):
    with pytest.raises(ValueError, match=r"experiment.reproduction" + message):
        check_entries([entry], KEYS)


def test_bad_entry_fails_before_any_arm_runs(tmp_path):
    cfg = RunConfig(
        workload=WorkloadConfig(num_requests=4),
        progress=False,
        experiment=ExperimentConfig(
            arms={"one": {"scheduler.name": "fcfs"}, "two": {"scheduler.name": "static"}},
            reproduction=[{"metric": "throughput_tok_s", "arm": "one", "paper": 1.0},
                          {"metric": "no_such_metric", "arm": "two", "paper": 1.0}],  # fmt: skip
        ),
    )
    with pytest.raises(ValueError, match=r"experiment.reproduction\[1\].metric: 'no_such_metric'"):
        run_experiment(cfg, tmp_path, verbose=False)
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize(
    "table, message",
    [
        ({"title": "t", "arms": ["one", "tow"], "metrics": ["e2e_s_mean"]}, r"\[0\]: unknown arms \['tow'\]"),
        ({"title": "t", "arms": ["one", "two"], "metrics": ["e2e_mean"]}, r"\[0\].metrics: \['e2e_mean'\] are in no"),
        ({"title": "t", "arms": ["one", "two"]}, r"\[0\].metrics is required"),
        ({"title": "t", "arms": ["one"], "metrics": ["e2e_s_mean"], "metric": ["x"]}, r"\[0\]: unknown keys \['metric'\]"),
    ],
)
def test_bad_table_fails_before_any_arm_runs(tmp_path, table, message):
    cfg = RunConfig(
        workload=WorkloadConfig(num_requests=4),
        progress=False,
        experiment=ExperimentConfig(arms={"one": {"scheduler.name": "fcfs"}, "two": {"scheduler.name": "static"}}, tables=[table]),
    )
    with pytest.raises(ValueError, match=r"experiment.tables" + message):
        run_experiment(cfg, tmp_path, verbose=False)
    assert not any(tmp_path.iterdir())


def test_a_table_metric_one_arm_lacks_and_a_dotted_one_are_accepted(tmp_path):
    table = {"title": "t", "arms": ["one", "two"], "metrics": ["e2e_s_mean", "client_service.default", "kv_host_pages_peak"]}
    cfg = RunConfig(
        workload=WorkloadConfig(num_requests=4),
        progress=False,
        experiment=ExperimentConfig(
            arms={"one": {"scheduler.name": "fcfs"}, "two": {"cache.host_pages": 64}}, tables=[table],
        ),
    )
    run_experiment(cfg, tmp_path, verbose=False)
    assert "kv_host_pages_peak" in (tmp_path / "comparison.md").read_text()


def test_experiment_writes_reproduction_json(tmp_path):
    cfg = RunConfig(
        workload=WorkloadConfig(num_requests=4),
        progress=False,
        experiment=ExperimentConfig(
            arms={"one": {"scheduler.name": "fcfs"}, "two": {"scheduler.name": "static"}},
            reproduction=[{"figure": "f", "metric": "num_finished", "arm": "one", "ratio_to": "two", "paper": 1.0,
                           "kind": "exact"}],  # fmt: skip
        ),
    )
    run_experiment(cfg, tmp_path, verbose=False)
    (row,) = json.loads((tmp_path / "reproduction.json").read_text())
    assert (row["ours"], row["verdict"]) == (1.0, "pass")
    assert "Reproduction: paper vs ours" in (tmp_path / "comparison.md").read_text()


def test_reproduction_without_arms_fails(tmp_path):
    cfg = RunConfig(experiment=ExperimentConfig(reproduction=[{"metric": "x", "arm": "a", "paper": 1.0}]))
    with pytest.raises(ValueError, match="experiment.reproduction: compares arms"):
        run_experiment(cfg, tmp_path, verbose=False)
