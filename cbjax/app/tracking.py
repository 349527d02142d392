"""Experiment tracking (logger=mlflow|tensorboard|wandb): a run's config, metrics and files.

Each backend's package is imported only when that logger is chosen (`pip install
'cbjax[tracking]'`). MLflow and TensorBoard write local files by default, so no server is
needed: `mlflow ui --backend-store-uri DIR/mlruns`, `tensorboard --logdir DIR/tensorboard`.
"""

from __future__ import annotations

import importlib
import os
import re
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from cbjax.config import LoggerConfig

PACKAGES = {"mlflow": "mlflow", "tensorboard": "tensorboardX", "wandb": "wandb"}
STORE_DIRS = ("mlruns", "tensorboard", "wandb")  # tracking stores, never logged as run files
FILE_SUFFIXES = (".json", ".yaml", ".md", ".csv", ".png")  # requests.jsonl can be large: left out
SKIP_FILES = ("complete.json",)
PARAMS_PER_BATCH, METRICS_PER_BATCH = 100, 1000  # MLflow's log_batch limits


def check_available(cfg: LoggerConfig) -> None:
    """Fail before a run, not after it, when the chosen logger's package is missing."""
    if cfg.name == "none":
        return
    try:
        importlib.import_module(PACKAGES[cfg.name])
    except ImportError as err:
        raise ValueError(
            f"logger={cfg.name}: needs the {PACKAGES[cfg.name]} package ({err}); "
            "pip install 'cbjax[tracking]' or the package itself"
        ) from None


def flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    """Nested dicts as dotted keys: {'scheduler': {'name': 'fcfs'}} -> {'scheduler.name': 'fcfs'}."""
    out: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, dict) and value:
            out.update(flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def numeric_metrics(summaries: dict[str, Any], arms: bool) -> dict[str, float]:
    """Numeric summary.json values; an experiment's as `arm/metric`."""
    by_arm = summaries if arms else {"": summaries}
    out = {}
    for arm, summary in by_arm.items():
        for key, value in summary.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                out[f"{arm}/{key}" if arm else key] = float(value)
    return out


def run_files(out_dir: Path) -> list[Path]:
    """The run's config, summaries, tables and plots (arm subdirs included), relative to out_dir."""
    files = []
    for path in sorted(out_dir.rglob("*")):
        rel = path.relative_to(out_dir)
        if any(part.startswith(".") or part in STORE_DIRS for part in rel.parts):
            continue
        if path.is_file() and path.suffix in FILE_SUFFIXES and path.name not in SKIP_FILES:
            files.append(rel)
    return files


def log_run(
    cfg: LoggerConfig,
    *,
    out_dir: Path,
    root: Path,
    run_name: str,
    config: dict[str, Any],
    summaries: dict[str, Any],
    arms: bool,
) -> None:
    """Log one finished run to the chosen backend. Default stores live under `root`."""
    if cfg.name == "none":
        return
    name = cfg.run_name or run_name
    params = flatten(config)
    metrics = numeric_metrics(summaries, arms)
    files = run_files(out_dir)
    backend = {"mlflow": _mlflow, "tensorboard": _tensorboard, "wandb": _wandb}[cfg.name]
    try:
        backend(cfg, Path(root), Path(out_dir), name, params, metrics, files)
    except Exception as err:  # after the run: one line naming the logger, not a library's traceback
        raise TrackingError(f"logger={cfg.name}: could not log the run in {out_dir}: {_first_line(err)}") from err


class TrackingError(RuntimeError):
    """The tracker refused a finished run; its outputs are on disk all the same."""


def check_store(cfg: LoggerConfig, root: Path) -> None:
    """Fail before a run, not after it, when the chosen tracker's store cannot be used (an
    MLflow tracking_uri of no known scheme, a server that does not answer): open it and get
    or create the experiment, as logging the finished run will."""
    if cfg.name != "mlflow":
        return
    try:
        _mlflow_experiment(cfg, Path(root))
    except Exception as err:  # MLflow raises its own, requests' and OS errors alike
        raise ValueError(f"logger.tracking_uri: cannot use the MLflow store {_mlflow_uri(cfg, Path(root))}: {_first_line(err)}") from None


def _first_line(err: BaseException) -> str:
    return (str(err).strip().splitlines() or [type(err).__name__])[0]


def _mlflow_uri(cfg: LoggerConfig, root: Path) -> str:
    return cfg.tracking_uri or (root / "mlruns").resolve().as_uri()


def _mlflow_experiment(cfg: LoggerConfig, root: Path):
    """(client, experiment id) of `cfg.experiment_name` in the store, created if missing."""
    from mlflow.exceptions import MlflowException
    from mlflow.tracking import MlflowClient

    uri = _mlflow_uri(cfg, root)
    if _is_file_store(uri):
        # MLflow 3 refuses a file store unless opted in; it is the no-server default we want.
        os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
    client = MlflowClient(tracking_uri=uri)
    experiment = client.get_experiment_by_name(cfg.experiment_name)
    if experiment is not None:
        return client, experiment.experiment_id
    try:
        return client, client.create_experiment(cfg.experiment_name)
    except MlflowException:  # a parallel job created it first
        return client, client.get_experiment_by_name(cfg.experiment_name).experiment_id


def _mlflow(cfg, root, out_dir, name, params, metrics, files) -> None:
    from mlflow.entities import Metric, Param

    client, experiment_id = _mlflow_experiment(cfg, root)
    run = client.create_run(experiment_id, run_name=name, tags={"cbjax.out_dir": str(out_dir.resolve())})
    run_id = run.info.run_id
    stamp = int(time.time() * 1000)
    param_list = [Param(k, str(v)) for k, v in params.items()]
    metric_list = [Metric(k, v, stamp, 0) for k, v in metrics.items()]
    for i in range(0, len(param_list), PARAMS_PER_BATCH):
        client.log_batch(run_id, params=param_list[i : i + PARAMS_PER_BATCH])
    for i in range(0, len(metric_list), METRICS_PER_BATCH):
        client.log_batch(run_id, metrics=metric_list[i : i + METRICS_PER_BATCH])
    for rel in files:
        parent = rel.parent.as_posix()
        client.log_artifact(run_id, str(out_dir / rel), None if parent == "." else parent)
    client.set_terminated(run_id)


def _is_file_store(uri: str) -> bool:
    """Whether MLflow reads `uri` as a file store: a file: URI, or a plain path (no scheme, or a
    Windows drive letter), which MLflow takes as a local directory."""
    scheme = urlparse(uri).scheme
    return scheme in ("", "file") or len(scheme) == 1


def _safe_dir_name(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9._=,+-]", "_", name)


def _tensorboard(cfg, root, out_dir, name, params, metrics, files) -> None:
    from matplotlib.image import imread
    from tensorboardX import SummaryWriter

    logdir = Path(cfg.save_dir or root / "tensorboard") / _safe_dir_name(name)
    with SummaryWriter(str(logdir)) as writer:
        for key, value in metrics.items():
            writer.add_scalar(key, value, 0)
        hparams = {k: v if isinstance(v, (int, float, str, bool)) else str(v) for k, v in params.items()}
        writer.add_hparams(hparams, metrics, name="hparams")
        for rel in files:
            if rel.suffix == ".png":
                writer.add_image(rel.as_posix(), imread(out_dir / rel)[..., :3], 0, dataformats="HWC")
            else:
                writer.add_text(rel.as_posix(), "    " + (out_dir / rel).read_text().replace("\n", "\n    "), 0)


def _wandb(cfg, root, out_dir, name, params, metrics, files) -> None:
    import wandb

    save_dir = Path(cfg.save_dir or root)
    save_dir.mkdir(parents=True, exist_ok=True)
    run = wandb.init(project=cfg.experiment_name, name=name, dir=str(save_dir), mode=cfg.wandb_mode, config=params)
    try:
        run.log(metrics)
        run.summary.update(metrics)
        images = {rel.as_posix(): wandb.Image(str(out_dir / rel)) for rel in files if rel.suffix == ".png"}
        if images:
            run.log(images)
        for rel in files:  # under the run dir's name: W&B keeps its own config.yaml in files/
            run.save(str(out_dir / rel), base_path=str(out_dir.parent), policy="now")
    finally:
        run.finish()
