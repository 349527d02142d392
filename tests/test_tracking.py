"""Experiment tracking: logger=mlflow and tensorboard write local stores we read back."""

from __future__ import annotations

import json
import struct
import subprocess
import sys

import pytest

from conftest import cbjax_cmd
from test_cli import composed
from test_sweeps import collect_sweep
from cbjax.config import LoggerConfig
from cbjax.app.run import run_experiment
from cbjax.app.sweep import comparable_config
from cbjax.app.tracking import TrackingError, check_available, flatten, log_run

TINY = ["progress=false", "workload.num_requests=20", "executor.cost_model=unit"]


def _numbers(summary):
    return {k: float(v) for k, v in summary.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}


@pytest.fixture
def mlflow_store(monkeypatch):
    """mlflow pointed at a file store; the fluent API's global tracking URI restored after."""
    mlflow = pytest.importorskip("mlflow")
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    previous = mlflow.get_tracking_uri()
    yield lambda path: mlflow.set_tracking_uri(path.resolve().as_uri())
    mlflow.set_tracking_uri(previous)


def test_logger_mlflow_writes_a_local_run_that_search_runs_reads_back(tmp_path, env_cpu, mlflow_store):
    import mlflow
    from mlflow.tracking import MlflowClient

    out = tmp_path / "run"
    cmd = cbjax_cmd() + ["logger=mlflow", *TINY, f"hydra.run.dir={out}"]
    proc = subprocess.run(cmd, env=env_cpu, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())

    mlflow_store(out / "mlruns")
    runs = mlflow.search_runs(experiment_names=["cbjax"], output_format="list")
    assert len(runs) == 1
    run = runs[0]
    assert run.info.status == "FINISHED" and run.info.run_name == "run"
    assert run.data.metrics == _numbers(summary) and run.data.metrics["num_requests"] == 20.0
    assert run.data.params["scheduler.name"] == "fcfs" and run.data.params["workload.num_requests"] == "20"
    artifacts = {a.path for a in MlflowClient().list_artifacts(run.info.run_id)}
    assert {"config.yaml", "summary.json"} <= artifacts and "requests.jsonl" not in artifacts
    # the store's copy of summary.json is not a job of the run dir
    jobs, _ = collect_sweep.find_jobs(out)
    assert [j.path for j in jobs] == [out.resolve()]


def test_mlflow_logs_an_experiments_arms_and_shares_one_store(tmp_path, mlflow_store):
    import mlflow

    cfg = composed("experiment=static_vs_continuous", *TINY)
    summaries = run_experiment(cfg, tmp_path / "exp", verbose=False)
    logger = LoggerConfig(name="mlflow", experiment_name="arms")
    for name in ("first", "second"):
        log_run(
            logger, out_dir=tmp_path / "exp", root=tmp_path, run_name=name,
            config=comparable_config(cfg), summaries=summaries, arms=True,
        )  # fmt: skip
    mlflow_store(tmp_path / "mlruns")
    runs = mlflow.search_runs(experiment_names=["arms"], output_format="list")
    assert sorted(r.info.run_name for r in runs) == ["first", "second"]
    metrics = runs[0].data.metrics
    assert metrics["static/throughput_tok_s"] == summaries["static"]["throughput_tok_s"]
    assert metrics["continuous/iterations"] == summaries["continuous"]["iterations"]
    assert len(metrics) == sum(len(_numbers(s)) for s in summaries.values())
    artifacts = {a.path for a in mlflow.tracking.MlflowClient().list_artifacts(runs[0].info.run_id, "static")}
    assert "static/summary.json" in artifacts


def test_mlflow_takes_a_plain_path_as_a_file_store(tmp_path, monkeypatch, mlflow_store):
    import mlflow

    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)  # as in a fresh process
    cfg = composed(*TINY)
    summary = run_experiment(cfg, tmp_path / "run", verbose=False)
    store = tmp_path / "store"
    log_run(
        LoggerConfig(name="mlflow", tracking_uri=str(store)), out_dir=tmp_path / "run", root=tmp_path,
        run_name="plain", config=comparable_config(cfg), summaries=summary, arms=False,
    )  # fmt: skip
    mlflow_store(store)
    (run,) = mlflow.search_runs(experiment_names=["cbjax"], output_format="list")
    assert run.info.run_name == "plain" and run.data.metrics == _numbers(summary)


def _events(path):
    """Records of a TensorBoard event file: u64 length, u32 crc, payload, u32 crc."""
    from tensorboardX.proto import event_pb2

    data, i = path.read_bytes(), 0
    while i < len(data):
        (n,) = struct.unpack("<Q", data[i : i + 8])
        event = event_pb2.Event()
        event.ParseFromString(data[i + 12 : i + 12 + n])
        i += 12 + n + 4
        yield event


def test_tensorboard_writes_summary_metrics_as_scalars(tmp_path):
    pytest.importorskip("tensorboardX")
    cfg = composed(*TINY)
    summary = run_experiment(cfg, tmp_path / "run", verbose=False)
    log_run(
        LoggerConfig(name="tensorboard"), out_dir=tmp_path / "run", root=tmp_path, run_name="a/b",
        config=comparable_config(cfg), summaries=summary, arms=False,
    )  # fmt: skip
    files = list((tmp_path / "tensorboard" / "a_b").glob("events.out.tfevents.*"))
    assert len(files) == 1  # the run name's slash does not nest a directory
    scalars, texts = {}, {}
    for event in _events(files[0]):
        for value in event.summary.value:
            if value.HasField("simple_value"):
                scalars[value.tag] = value.simple_value
            elif value.HasField("tensor"):
                texts[value.tag] = value.tensor.string_val[0].decode()
    expected = _numbers(summary)
    assert set(scalars) == set(expected)
    assert all(scalars[k] == pytest.approx(v, rel=1e-6) for k, v in expected.items())  # float32 on disk
    assert "scheduler:" in texts["config.yaml/text_summary"]


def test_a_missing_tracking_package_fails_before_the_run_naming_the_logger(monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb raises ImportError
    with pytest.raises(ValueError, match=r"logger=wandb: needs the wandb package"):
        check_available(LoggerConfig(name="wandb"))
    check_available(LoggerConfig(name="none"))
    with pytest.raises(ValueError, match="logger.name: unknown value 'mlfow'"):
        composed("logger.name=mlfow")


def test_an_unusable_mlflow_store_fails_before_the_run_naming_the_key(tmp_path):
    from types import SimpleNamespace

    from hydra.types import RunMode

    from cbjax.app.hydra_job import run_hydra_job

    cfg = composed(*TINY, "logger=mlflow", "logger.tracking_uri=nosuch://x")
    hydra_cfg = SimpleNamespace(mode=RunMode.RUN, sweep=SimpleNamespace(dir=str(tmp_path)), job=SimpleNamespace(override_dirname=""))
    calls = []
    with pytest.raises(ValueError, match=r"logger.tracking_uri: cannot use the MLflow store nosuch://x: "):
        run_hydra_job(cfg, tmp_path, hydra_cfg, run=lambda c, d: calls.append(1) or run_experiment(c, d, verbose=False))
    assert calls == [] and not (tmp_path / "summary.json").exists()


def test_a_tracker_failing_after_the_run_says_so_in_one_line(tmp_path):
    pytest.importorskip("tensorboardX")
    cfg = composed(*TINY)
    summary = run_experiment(cfg, tmp_path / "run", verbose=False)
    (tmp_path / "file").write_text("")
    logger = LoggerConfig(name="tensorboard", save_dir=str(tmp_path / "file" / "tb"))  # under a file: unwritable
    with pytest.raises(TrackingError, match=r"^logger=tensorboard: could not log the run in .*run: .*file"):
        log_run(
            logger, out_dir=tmp_path / "run", root=tmp_path, run_name="a",
            config=comparable_config(cfg), summaries=summary, arms=False,
        )  # fmt: skip


def test_flatten_joins_nested_keys_with_dots():
    tree = {"a": {"b": 1, "c": {"d": [2, 3]}}, "e": None, "f": {}}
    assert flatten(tree) == {"a.b": 1, "a.c.d": [2, 3], "e": None, "f": {}}
