"""Sweep jobs that resume: a job skips a dir that already holds a complete run of its config.

A run is complete once `complete.json` exists, parses, records the same config, and the run's
summary (summary.json, or comparison.json for an experiment) parses and was not interrupted.
The job writes complete.json last, after every output and the tracking upload, and deletes it
before it starts, so a run killed at any point (or rerun with overwrite=true and killed) never
counts.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import time
from pathlib import Path
from typing import Any, Callable, Optional

from cbjax.config import RunConfig

COMPLETE = "complete.json"
SKIPPED = ".skipped"  # this job was skipped by the latest invocation of its sweep
# Root keys that change no output, so a rerun that differs only in them is still the same run.
UNCOMPARED = ("progress", "overwrite", "logger")

log = logging.getLogger(__name__)


def comparable_config(cfg: RunConfig) -> dict[str, Any]:
    """The config a run is compared by: JSON-normal (tuples as lists), without UNCOMPARED keys."""
    tree = {k: v for k, v in dataclasses.asdict(cfg).items() if k not in UNCOMPARED}
    return json.loads(json.dumps(tree))


def read_summaries(out_dir: Path, cfg: RunConfig) -> Optional[dict[str, Any]]:
    """The run's summary (or an experiment's summaries by arm), None when missing or unparsable."""
    path = out_dir / ("comparison.json" if cfg.experiment.arms else "summary.json")
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def interrupted(summaries: dict[str, Any], cfg: RunConfig) -> bool:
    """Whether a run stopped early: its summary says so, or an experiment lacks an arm."""
    if not cfg.experiment.arms:
        return bool(summaries.get("interrupted"))
    arms = [summaries.get(name) for name in cfg.experiment.arms]
    return any(not isinstance(s, dict) or s.get("interrupted") for s in arms)


def completed(out_dir: Path, cfg: RunConfig) -> Optional[dict[str, Any]]:
    """The summaries of a complete run of `cfg` in `out_dir`; None if there is none."""
    try:
        record = json.loads((out_dir / COMPLETE).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(record, dict) or record.get("config") != comparable_config(cfg):
        return None
    summaries = read_summaries(out_dir, cfg)
    return None if summaries is None or interrupted(summaries, cfg) else summaries


def mark_complete(out_dir: Path, cfg: RunConfig, started_at: float) -> None:
    """Write complete.json atomically: a temp file renamed over the target."""
    record = {"config": comparable_config(cfg), "started_at": started_at, "finished_at": time.time()}
    tmp = out_dir / f".{COMPLETE}.{os.getpid()}.tmp"
    tmp.write_text(json.dumps(record, indent=1) + "\n")
    os.replace(tmp, out_dir / COMPLETE)


def objective(cfg: RunConfig, summary: dict[str, Any]) -> Optional[float]:
    """summary[optimized_metric] as a float for a sweeper; None when no metric is configured."""
    key = cfg.optimized_metric
    if key is None:
        return None
    if key not in summary:
        raise ValueError(f"optimized_metric: {key!r} is not in summary.json; keys are {', '.join(sorted(summary))}")
    value = summary[key]
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise ValueError(f"optimized_metric: summary.json has {key} = {value!r}, not a number")
    return float(value)


def check_objective(cfg: RunConfig) -> None:
    """Fail before a simulated run, not after it, when `optimized_metric` names no key its
    summary.json will have (the simulator's keys are known up front: `summary_keys`). The
    engine adds counters of its own, so an engine run's key is checked once it has run."""
    key = cfg.optimized_metric
    if key is None or cfg.executor.name != "sim":
        return
    from cbjax.app.run import summary_keys

    keys = summary_keys(cfg)
    if key not in keys:
        raise ValueError(f"optimized_metric: {key!r} is not in summary.json; keys are {', '.join(sorted(keys))}")


def run_job(
    cfg: RunConfig,
    out_dir: Path,
    run: Callable[[RunConfig, Path], dict[str, Any]],
    *,
    resume: bool,
    track: Optional[Callable[[dict[str, Any]], None]] = None,
) -> Optional[float]:
    """Run one job into `out_dir` (or, with `resume` and not overwrite, skip a complete one).

    `run` serves the config and writes its outputs; `track` logs them after the run.
    Returns the objective for a sweeper (see `objective`)."""
    out_dir = Path(out_dir)
    check_objective(cfg)
    if resume and not cfg.overwrite:
        done = completed(out_dir, cfg)
        if done is not None:
            (out_dir / SKIPPED).touch()
            log.info(f"skipped: {out_dir} holds a complete run of this config (overwrite=true reruns it)")
            return objective(cfg, done)
    out_dir.mkdir(parents=True, exist_ok=True)
    for name in (COMPLETE, SKIPPED):
        (out_dir / name).unlink(missing_ok=True)
    started_at = time.time()
    summaries = run(cfg, out_dir)
    if interrupted(summaries, cfg):  # saved, but not complete: the next sweep reruns it
        return None
    if track is not None:
        track(summaries)
    mark_complete(out_dir, cfg, started_at)
    return objective(cfg, summaries)


def count_skipped(sweep_dir: Path) -> tuple[int, int]:
    """(jobs the latest invocation skipped, complete jobs) under a sweep dir."""
    if not sweep_dir.is_dir():
        return 0, 0
    return len(list(sweep_dir.rglob(SKIPPED))), len(list(sweep_dir.rglob(COMPLETE)))


def clear_skipped(sweep_dir: Path) -> None:
    """Forget the previous invocation's skips, so the next count is this invocation's."""
    if sweep_dir.is_dir():
        for path in sweep_dir.rglob(SKIPPED):
            path.unlink(missing_ok=True)
