"""Sweeps: joblib jobs in parallel, resume after a kill, optuna search, resume rules."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import time

import pytest
import yaml

from conftest import REPO, cbjax_cmd
from test_cli import composed
from cbjax.app.run import run_experiment, with_overrides
from cbjax.app.sweep import COMPLETE, SKIPPED, interrupted, objective, run_job

_spec = importlib.util.spec_from_file_location("collect_sweep", REPO / "experiments" / "collect_sweep.py")
collect_sweep = sys.modules["collect_sweep"] = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(collect_sweep)

# Four jobs on two joblib workers: two short ones first, then two long enough (about a second
# each) that a kill right after the short ones lands while the long ones are running.
JOBLIB_SWEEP = [
    "-m", "hydra/launcher=joblib", "hydra.launcher.n_jobs=2", "workload.num_requests=12,3000", "seed=0,1",
    "executor.cost_model=unit", "progress=false",
]  # fmt: skip
SHORT_JOBS, LONG_JOBS = ("0", "1"), ("2", "3")
TINY = ["progress=false", "workload.num_requests=12", "executor.cost_model=unit"]


def _sweep(sweep_dir, env, *extra, timeout=240):
    cmd = [*cbjax_cmd(), *JOBLIB_SWEEP, f"hydra.sweep.dir={sweep_dir}", *extra]
    proc = subprocess.run(cmd, cwd=sweep_dir.parent, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout + proc.stderr


def _record(job_dir):
    return json.loads((job_dir / COMPLETE).read_text())


def _max_concurrent(intervals):
    events = sorted([(start, 1) for start, _ in intervals] + [(end, -1) for _, end in intervals])
    running = peak = 0
    for _, step in events:  # an end sorts before a start at the same instant
        running += step
        peak = max(peak, running)
    return peak


def _table(sweep_dir, out):
    collect_sweep.collect(sweep_dir, out=out)
    return (out.parent / f"{out.name}.csv").read_text()


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    sweep_dir = tmp_path_factory.mktemp("uninterrupted") / "sweep"
    _sweep(sweep_dir, env)
    return sweep_dir, env


def test_joblib_sweep_runs_two_jobs_at_a_time(uninterrupted):
    sweep_dir, _ = uninterrupted
    intervals = [(r["started_at"], r["finished_at"]) for r in map(_record, sorted(sweep_dir.glob("*/")))]
    assert len(intervals) == 4
    assert _max_concurrent(intervals) == 2


def test_killed_sweep_resumes_skipping_finished_jobs_and_matches_an_uninterrupted_one(uninterrupted, tmp_path):
    reference, env = uninterrupted
    sweep_dir = tmp_path / "sweep"
    cmd = [*cbjax_cmd(), *JOBLIB_SWEEP, f"hydra.sweep.dir={sweep_dir}"]
    proc = subprocess.Popen(
        cmd, cwd=tmp_path, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
    )
    try:
        deadline = time.monotonic() + 180
        # kill once the short jobs are done and a long one has started (Hydra wrote its .hydra/)
        while not (
            all((sweep_dir / j / COMPLETE).is_file() for j in SHORT_JOBS)
            and any((sweep_dir / j / ".hydra" / "overrides.yaml").is_file() for j in LONG_JOBS)
        ):
            assert proc.poll() is None and time.monotonic() < deadline, "the short jobs never finished"
            time.sleep(0.01)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # the launcher and its joblib workers
        proc.wait()
    done = {j for j in (*SHORT_JOBS, *LONG_JOBS) if (sweep_dir / j / COMPLETE).is_file()}
    assert set(SHORT_JOBS) <= done and len(done) < 4, done
    killed = [j for j in LONG_JOBS if j not in done]
    assert any((sweep_dir / j / ".hydra").is_dir() for j in killed)  # killed mid-run
    before = {j: _record(sweep_dir / j) for j in done}

    out = _sweep(sweep_dir, env)
    assert f"sweep: skipped {len(done)} jobs already complete" in out
    for j in done:  # not rerun: the record is the first run's
        assert _record(sweep_dir / j) == before[j] and (sweep_dir / j / SKIPPED).is_file()
    for j in killed:
        assert (sweep_dir / j / COMPLETE).is_file() and not (sweep_dir / j / SKIPPED).exists()
    assert _table(sweep_dir, tmp_path / "resumed") == _table(reference, tmp_path / "reference")


def test_resume_skips_only_a_complete_run_of_the_same_config(tmp_path):
    calls = []

    def run(cfg, out_dir):
        calls.append(cfg.seed)
        return run_experiment(cfg, out_dir, verbose=False)

    cfg = composed(*TINY)
    run_job(cfg, tmp_path, run, resume=True)
    run_job(cfg, tmp_path, run, resume=True)
    run_job(with_overrides(cfg, {"progress": True}), tmp_path, run, resume=True)  # changes no output
    assert calls == [0] and (tmp_path / SKIPPED).is_file()
    run_job(cfg, tmp_path, run, resume=False)  # a single run (no multirun) always runs
    run_job(with_overrides(cfg, {"seed": 1}), tmp_path, run, resume=True)  # another config
    run_job(with_overrides(cfg, {"seed": 1, "overwrite": True}), tmp_path, run, resume=True)
    assert calls == [0, 0, 1, 1] and not (tmp_path / SKIPPED).exists()


def test_a_run_killed_before_its_record_is_rerun(tmp_path):
    cfg = composed(*TINY)
    calls = []

    def killed(cfg, out_dir):
        run_experiment(cfg, out_dir, verbose=False)  # every output is written...
        raise KeyboardInterrupt  # ...but the job dies before complete.json

    run_job(cfg, tmp_path, lambda c, d: run_experiment(c, d, verbose=False), resume=True)
    with pytest.raises(KeyboardInterrupt):
        run_job(with_overrides(cfg, {"overwrite": True}), tmp_path, killed, resume=True)
    assert (tmp_path / "summary.json").is_file() and not (tmp_path / COMPLETE).exists()
    run_job(cfg, tmp_path, lambda c, d: calls.append(1) or run_experiment(c, d, verbose=False), resume=True)
    assert calls == [1] and (tmp_path / COMPLETE).is_file()

    (tmp_path / "summary.json").write_text('{"num_requests": 1')  # torn: not a complete run
    run_job(cfg, tmp_path, lambda c, d: calls.append(2) or run_experiment(c, d, verbose=False), resume=True)
    assert calls == [1, 2]


def test_an_interrupted_run_is_saved_but_not_complete(tmp_path):
    cfg = composed(*TINY, "optimized_metric=throughput_tok_s")

    def stopped(cfg, out_dir):  # a run stopped by a signal saves its outputs, marked interrupted
        return {**run_experiment(cfg, out_dir, verbose=False), "interrupted": True}

    assert run_job(cfg, tmp_path, stopped, resume=True) is None
    assert (tmp_path / "summary.json").is_file() and not (tmp_path / COMPLETE).exists()
    exp = composed("experiment=static_vs_continuous", *TINY)
    arm = {"throughput_tok_s": 1.0}
    assert interrupted({"static": arm, "continuous": arm}, exp)  # an arm is missing
    assert interrupted({"static": arm, "continuous": arm, "continuous_reserve_max": {"interrupted": True}}, exp)
    assert not interrupted({"static": arm, "continuous": arm, "continuous_reserve_max": arm}, exp)


def test_optimized_metric_is_the_jobs_return_value_and_fails_naming_the_key(tmp_path):
    cfg = composed(*TINY, "optimized_metric=goodput_req_s")
    value = run_job(cfg, tmp_path, lambda c, d: run_experiment(c, d, verbose=False), resume=True)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert value == summary["goodput_req_s"] == summary["throughput_req_s"]  # no SLO: every request is good
    assert run_job(cfg, tmp_path, None, resume=True) == value  # skipped: read back from summary.json
    with pytest.raises(ValueError, match="optimized_metric: 'goodput' is not in summary.json"):
        objective(with_overrides(cfg, {"optimized_metric": "goodput"}), summary)
    with pytest.raises(
        ValueError, match="optimized_metric needs a single run, but experiment 'static_vs_continuous' has arms"
    ):
        composed("experiment=static_vs_continuous", "optimized_metric=goodput_req_s")


def test_a_misspelled_optimized_metric_fails_before_the_run(tmp_path):
    calls = []
    cfg = composed(*TINY, "optimized_metric=goodput")
    with pytest.raises(ValueError, match="optimized_metric: 'goodput' is not in summary.json; keys are .*goodput_req_s"):
        run_job(cfg, tmp_path, lambda c, d: calls.append(1) or run_experiment(c, d, verbose=False), resume=True)
    assert calls == [] and not (tmp_path / COMPLETE).exists() and not (tmp_path / "summary.json").exists()


def test_optuna_search_of_8_trials_reports_the_best_config(tmp_path):
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    sweep_dir = tmp_path / "search"
    cmd = [
        *cbjax_cmd(), "hparams_search=mlfq_goodput", "hydra.sweeper.n_trials=8", "workload.num_requests=40",
        "slo.ttft_s=0.05", f"hydra.sweep.dir={sweep_dir}",
    ]  # fmt: skip
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    trials = {}
    for job in sorted(sweep_dir.glob("*/summary.json")):
        overrides = dict(o.split("=", 1) for o in yaml.safe_load((job.parent / ".hydra/overrides.yaml").read_text()))
        params = {k: v for k, v in overrides.items() if k.startswith("scheduler.mlfq_")}
        trials[job.parent.name] = (json.loads(job.read_text())["goodput_req_s"], params)
    assert len(trials) == 8 and all(len(p) == 3 for _, p in trials.values())
    results = yaml.safe_load((sweep_dir / "optimization_results.yaml").read_text())
    best = max(v for v, _ in trials.values())
    assert results["best_value"] == best
    best_params = {k: str(v) for k, v in results["best_params"].items()}
    assert best_params in [p for v, p in trials.values() if v == best]
    assert "Best parameters" in proc.stdout + proc.stderr

    text = collect_sweep.collect(sweep_dir, out=tmp_path / "table")
    assert text.startswith(f"optuna best: {collect_sweep.format_number(best)} at scheduler.mlfq_base_quantum=")
    header = next(line for line in text.splitlines() if line.startswith("| scheduler."))
    assert header.index("goodput_req_s") < header.index("throughput_tok_s")  # the objective comes first


def test_a_search_keeps_other_libraries_info_off_stdout(tmp_path):
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    cmd = [
        *cbjax_cmd(), "hparams_search=mlfq_goodput", "hydra.sweeper.n_trials=1", "workload.num_requests=5",
        f"hydra.sweep.dir={tmp_path / 'search'}",
    ]  # fmt: skip
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Best value" in proc.stdout and "sweep: skipped 0 jobs" in proc.stdout  # Hydra's, its plugins', cbjax's
    # the Optuna sweeper imports alembic, whose plugin setup logs at INFO: not cbjax's output
    assert "alembic" not in proc.stdout and "setup plugin" not in proc.stdout


def _compose_with_hydra(*overrides):
    from hydra import compose, initialize_config_dir
    from omegaconf import open_dict

    from cbjax.app.cli import CONFIG_DIR, to_run_config

    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        cfg = compose(config_name="config", overrides=list(overrides), return_hydra_config=True)
    hydra_cfg = cfg.hydra
    with open_dict(cfg):
        del cfg["hydra"]
    return to_run_config(cfg), hydra_cfg


def test_the_mlfq_search_has_something_to_find():
    """Its setting is over capacity on a real accelerator's shape: trials differ in goodput,
    and the latencies are milliseconds, not a toy model's nanoseconds."""
    from cbjax.app.run import run_single

    base, _ = _compose_with_hydra("hparams_search=mlfq_goodput")
    summaries = [
        run_single(with_overrides(base, {"scheduler": {"mlfq_base_quantum": q, "mlfq_num_queues": n, "mlfq_preempt": p}}),
                   verbose=False)  # fmt: skip
        for q, n, p in [(4, 1, False), (8, 8, True)]  # one queue, no preemption: FCFS; short quanta, preempting
    ]
    fcfs, mlfq = (s["goodput_req_s"] for s in summaries)
    assert mlfq > 1.5 * fcfs
    assert all(s["tpot_s_p50"] > 1e-3 and s["ttft_s_p99"] > 0.1 for s in summaries)

def test_launcher_search_and_logger_configs_compose():
    _, hydra_cfg = _compose_with_hydra("hydra/launcher=joblib")
    assert hydra_cfg.launcher._target_.endswith("JoblibLauncher")
    _, hydra_cfg = _compose_with_hydra("hydra/launcher=slurm", "hydra.launcher.partition=gpu")
    assert hydra_cfg.launcher._target_.endswith("SlurmLauncher")
    assert (hydra_cfg.launcher.partition, hydra_cfg.launcher.timeout_min) == ("gpu", 120)
    cfg, hydra_cfg = _compose_with_hydra("hparams_search=mlfq_goodput")
    assert cfg.scheduler.name == "mlfq" and cfg.optimized_metric == "goodput_req_s" and cfg.slo.ttft_s == 0.5
    assert hydra_cfg.sweeper._target_.endswith("OptunaSweeper") and hydra_cfg.sweeper.direction == "maximize"
    assert set(hydra_cfg.sweeper.params) == {f"scheduler.mlfq_{k}" for k in ("base_quantum", "num_queues", "preempt")}
    cfg, hydra_cfg = _compose_with_hydra("hparams_search=chunked_prefill_goodput")
    assert cfg.scheduler.chunked_prefill and cfg.model.name == "llama2_7b"
    assert "scheduler.max_num_batched_tokens" in hydra_cfg.sweeper.params
    for name in ("none", "mlflow", "tensorboard", "wandb"):
        assert _compose_with_hydra(f"logger={name}")[0].logger.name == name
    assert _compose_with_hydra()[0].logger.name == "none" and not _compose_with_hydra()[0].overwrite


def test_ray_cluster_launcher_config_composes():
    pytest.importorskip("hydra_plugins.hydra_ray_launcher", reason="hydra-ray-launcher is in the sweeps extra")
    _, hydra_cfg = _compose_with_hydra("hydra/launcher=ray_cluster")
    assert hydra_cfg.launcher._target_.endswith("RayLauncher") and hydra_cfg.launcher.ray.init.address == "auto"
