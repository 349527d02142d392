"""experiments/collect_sweep.py over a real tiny Hydra multirun: CSV, markdown, plot and errors."""

from __future__ import annotations

import csv
import importlib.util
import json
import os
import shutil
import subprocess
import sys

import pytest
import yaml

from conftest import REPO, cbjax_cmd

SCRIPT = REPO / "experiments" / "collect_sweep.py"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
# rates 2 and 10: a string sort would put "10" first
EXPECTED = [("fcfs", "2"), ("fcfs", "10"), ("static", "2"), ("static", "10")]

_spec = importlib.util.spec_from_file_location("collect_sweep", SCRIPT)
collect_sweep = sys.modules["collect_sweep"] = importlib.util.module_from_spec(_spec)  # dataclasses look it up
_spec.loader.exec_module(collect_sweep)


def _env():
    env = dict(os.environ)
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    return env


@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
    """A 2 schedulers x 2 rates multirun on the unit-cost simulator."""
    sweep_dir = tmp_path_factory.mktemp("sweep")
    cmd = [
        *cbjax_cmd(), "-m",
        "scheduler=static,fcfs", "workload.rate=2,10", "workload.arrival=poisson", "workload.num_requests=30",
        "executor.cost_model=unit", "progress=false", f"hydra.sweep.dir={sweep_dir}",
    ]  # fmt: skip
    proc = subprocess.run(cmd, cwd=sweep_dir, env=_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return sweep_dir


def _read_csv(path):
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def _summaries_by_label(sweep_dir):
    out = {}
    for job in sweep_dir.glob("*/summary.json"):
        items = yaml.safe_load((job.parent / ".hydra" / "overrides.yaml").read_text())
        overrides = dict(item.split("=", 1) for item in items)
        out[(overrides["scheduler"], overrides["workload.rate"])] = json.loads(job.read_text())
    return out


def test_collects_every_job_sorted_with_its_own_metrics(sweep, capsys):
    assert collect_sweep.main([str(sweep)]) == 0
    printed = capsys.readouterr().out

    rows = _read_csv(sweep / "sweep.csv")
    assert [(r["scheduler"], r["workload.rate"]) for r in rows] == EXPECTED
    assert {r["workload.arrival"] for r in rows} == {"poisson"}
    assert "progress" not in rows[0] and not any(k.startswith("hydra.") for k in rows[0])

    summaries = _summaries_by_label(sweep)
    assert len(summaries) == 4
    for row in rows:
        summary = summaries[(row["scheduler"], row["workload.rate"])]
        assert summary["scheduler"] == row["scheduler"]
        for metric in collect_sweep.DEFAULT_METRICS:
            assert float(row[metric]) == summary[metric], (row["scheduler"], row["workload.rate"], metric)

    md = (sweep / "sweep.md").read_text()
    assert "| scheduler | workload.rate | throughput_tok_s" in md
    assert "fixed: workload.arrival=poisson" in md
    table = md.split("\n\n", 1)[1]
    assert table.strip().splitlines()[0] in printed
    assert len([line for line in printed.splitlines() if line.startswith("| fcfs") or line.startswith("| static")]) == 4
    assert (sweep / "sweep.png").read_bytes()[:8] == PNG_MAGIC


def test_chosen_metrics_out_prefix_and_bar_chart(sweep, tmp_path, capsys):
    out = tmp_path / "deeper" / "res"
    args = [str(sweep), "--metrics", "iterations,e2e_s_p99", "--x", "scheduler", "--out", str(out)]
    assert collect_sweep.main(args) == 0
    header = next(csv.reader(open(f"{out}.csv")))
    assert header[-2:] == ["iterations", "e2e_s_p99"]
    assert "| iterations | e2e_s_p99 |" in capsys.readouterr().out
    assert open(f"{out}.png", "rb").read(8) == PNG_MAGIC


def test_experiment_arms_without_hydra_are_labelled_by_dir(sweep, tmp_path):
    for arm, job in (("static", "0"), ("continuous", "1")):
        (tmp_path / arm).mkdir()
        shutil.copy(sweep / job / "summary.json", tmp_path / arm / "summary.json")
    assert collect_sweep.main([str(tmp_path), "--metrics", "scheduler,iterations"]) == 0
    rows = _read_csv(tmp_path / "sweep.csv")
    assert [r["arm"] for r in rows] == ["continuous", "static"]
    assert (tmp_path / "sweep.png").read_bytes()[:8] == PNG_MAGIC


def test_single_run_dir(sweep, tmp_path, capsys):
    assert collect_sweep.main([str(sweep / "0"), "--out", str(tmp_path / "one")]) == 0
    rows = _read_csv(tmp_path / "one.csv")
    assert len(rows) == 1 and rows[0]["scheduler"] == "static" and rows[0]["workload.rate"] == "2"


def test_interrupted_jobs_are_left_out_and_named(sweep, tmp_path, capsys):
    copy = tmp_path / "sweep"
    shutil.copytree(sweep, copy, ignore=shutil.ignore_patterns("sweep.*"))
    stopped = copy / "0" / "summary.json"  # static at rate 2, stopped by a signal part way
    stopped.write_text(json.dumps({**json.loads(stopped.read_text()), "interrupted": True}))
    assert collect_sweep.main([str(copy)]) == 0
    assert "left out 1 interrupted (partial) runs, which a rerun of the sweep finishes: 0" in capsys.readouterr().out
    rows = _read_csv(copy / "sweep.csv")
    assert [(r["scheduler"], r["workload.rate"]) for r in rows] == [e for e in EXPECTED if e != ("static", "2")]
    for job in "123":
        summary = copy / job / "summary.json"
        summary.write_text(json.dumps({**json.loads(summary.read_text()), "interrupted": True}))
    assert collect_sweep.main([str(copy)]) == 2
    assert "every run was interrupted (4)" in capsys.readouterr().err


def test_dir_without_summaries_names_it(tmp_path, capsys):
    assert collect_sweep.main([str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert str(tmp_path) in err and "no summary.json" in err


def test_unknown_metric_lists_available_keys(sweep, tmp_path, capsys):
    out = str(tmp_path / "x")
    assert collect_sweep.main([str(sweep), "--metrics", "throughput_tok_s,tokens_per_banana", "--out", out]) == 2
    err = capsys.readouterr().err
    assert "tokens_per_banana" in err and "ttft_s_p50" in err and "slot_utilization" in err
    assert collect_sweep.main([str(sweep), "--y", "nope", "--out", out]) == 2
    assert "nope" in capsys.readouterr().err
    assert collect_sweep.main([str(sweep), "--x", "workload.seed", "--out", out]) == 2
    assert "workload.rate" in capsys.readouterr().err


def test_cli_exit_status_and_no_jax(sweep, tmp_path):
    bad = subprocess.run([sys.executable, str(SCRIPT), str(tmp_path)], env=_env(), capture_output=True, text=True)
    assert bad.returncode != 0 and str(tmp_path) in bad.stderr
    code = (
        f"import sys, runpy; sys.argv = ['collect_sweep', {str(sweep)!r}, '--out', {str(tmp_path / 'cli')!r}]\n"
        f"try:\n    runpy.run_path({str(SCRIPT)!r}, run_name='__main__')\n"
        "except SystemExit as e:\n    assert e.code == 0, e.code\n"
        "assert 'jax' not in sys.modules, 'collect_sweep imported jax'\n"
    )
    ok = subprocess.run([sys.executable, "-c", code], env=_env(), capture_output=True, text=True)
    assert ok.returncode == 0, ok.stderr
    assert "| scheduler" in ok.stdout and (tmp_path / "cli.png").is_file()
