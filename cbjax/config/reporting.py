"""What a run reports and where: experiment arms and tables, metrics, SLOs and experiment tracking."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Optional

from cbjax.config.checks import _one_of, _require

LOGGERS = ("none", "mlflow", "tensorboard", "wandb")
WANDB_MODES = ("offline", "online", "disabled")


@dataclass
class ExperimentConfig:
    """Arms are named sets of dotted overrides run one after another and compared."""

    name: str = "single"
    arms: dict[str, dict[str, Any]] = field(default_factory=dict)
    # Each table: {title: str, arms: [name, ...], metrics: [key, ...]}; ratios are vs the first arm.
    tables: list[dict[str, Any]] = field(default_factory=list)
    # Published numbers to check against the arms' summaries (schema: cbjax.report.reproduction).
    reproduction: list[dict[str, Any]] = field(default_factory=list)
    # The settings of the reproduction rows any knob (an overhead, a modelling choice) was fitted
    # or chosen on; every other row is held out (cbjax.report.reproduction.fit_flags).
    fit_rows: list[str] = field(default_factory=list)
    # Where ours differs from the paper, the modelling difference that explains it (for
    # docs/REPRODUCTIONS.md, written by experiments/reproduce.py).
    notes: str = ""


@dataclass
class ServiceWeights:
    """VTC's service cost per token (Sheng et al., OSDI'24 use input 1, output 2)."""

    input: float = 1.0
    output: float = 2.0


@dataclass
class MetricsConfig:
    """What summary.json measures beyond the defaults (see cbjax.report.service)."""

    # client_service in summary.json and client_service.csv weigh tokens with these.
    service_weights: ServiceWeights = field(default_factory=ServiceWeights)
    # [start, end] in seconds: restrict the summary to this window (rules in cbjax.report.service).
    window_s: Optional[list[float]] = None
    # Bin width of client_service.csv, which spans the whole run (a window too). None: a
    # hundredth of the run.
    series_bin_s: Optional[float] = None

    def __post_init__(self) -> None:
        for key in ("input", "output"):
            value = getattr(self.service_weights, key)
            _require(value >= 0 and math.isfinite(value), f"metrics.service_weights.{key}", "must be >= 0", value)
        if self.window_s is not None:
            ok = len(self.window_s) == 2 and 0 <= self.window_s[0] < self.window_s[1] < math.inf
            _require(ok, "metrics.window_s", "must be [start, end] with 0 <= start < end", self.window_s)
            self.window_s = [float(x) for x in self.window_s]
        if self.series_bin_s is not None:
            _require(self.series_bin_s > 0, "metrics.series_bin_s", "must be > 0", self.series_bin_s)


@dataclass
class SLOConfig:
    """Latency targets: a served request meets its SLO when both hold (None: no target)."""

    ttft_s: Optional[float] = None
    tpot_s: Optional[float] = None

    def __post_init__(self) -> None:
        for key in ("ttft_s", "tpot_s"):
            value = getattr(self, key)
            if value is not None:
                _require(value > 0, f"slo.{key}", "must be > 0", value)


@dataclass
class LoggerConfig:
    """Experiment tracking of the `cbjax` command (cbjax.app.tracking); each backend reads its own knobs."""

    name: str = "none"
    experiment_name: str = "cbjax"  # MLflow experiment, W&B project
    run_name: Optional[str] = None  # None: the job's overrides in a sweep, else the run dir's name
    # mlflow. None: a file store, mlruns/ in the sweep dir (multirun) or the run dir (no server)
    tracking_uri: Optional[str] = None
    # tensorboard and wandb. None: tensorboard/ or wandb/ beside that mlruns/
    save_dir: Optional[str] = None
    wandb_mode: str = "offline"  # offline needs no account; `wandb sync` uploads later

    def __post_init__(self) -> None:
        _one_of("logger.name", self.name, LOGGERS)
        _one_of("logger.wandb_mode", self.wandb_mode, WANDB_MODES)
        _require(bool(self.experiment_name), "logger.experiment_name", "must be non-empty", self.experiment_name)
