"""The profile's anchor: one fixed closed-loop burst served on the warm engine, timed through the
profile and again around each of `experiments/calibrate.py`'s engine runs.

A profile predicts the engine at the machine speed it was taken at. A shared VM's speed drifts
(10-40% within minutes, in spells of seconds), so a profile taken in a slow spell makes the
simulator slow against engine runs made in a fast one, and no model can be nearer than the
drift. The anchor tells the two apart: the profile records its timings and their median
(`reference_s`); the calibration times it again before and after each engine run, and judges
only the runs made while the machine ran within SPEED_TOLERANCE of that reference
(`anchor_speed`, `on_speed`), counting the others. Nothing is rescaled: a run is measured at the
profile's speed or not counted, and the profile's served rounds are fitted as measured.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional, Sequence

import numpy as np

from cbjax.config import RunConfig, SchedulerConfig, SpecConfig, WorkloadConfig
from cbjax.app.config_merge import from_dict

# served back to back per anchor timing; the timing is their median (one burst of a tiny model
# lasts ~0.1 s and spreads ~10% run to run on a steady machine)
ANCHOR_RUNS = 5
# ... or fewer, once they add up to this many seconds (a larger model's burst lasts seconds)
ANCHOR_BUDGET_S = 1.0
# a calibration run counts when the anchors before and after it ran within this share of the
# profile's reference
SPEED_TOLERANCE = 0.05


def anchor_spec(run_cfg: RunConfig) -> dict[str, Any]:
    """What the profile file keeps of the anchor's run config (`run_cfg`: one of the profile's own
    closed-loop bursts): its scheduler, workload, speculation and seed, so that a calibration
    with the profile's model and cache rebuilds the same run (`anchor_config`)."""
    return {
        "scheduler": dataclasses.asdict(run_cfg.scheduler),
        "workload": dataclasses.asdict(run_cfg.workload),
        "spec": dataclasses.asdict(run_cfg.spec),
        "seed": run_cfg.seed,
    }


def anchor_config(base: RunConfig, spec: dict[str, Any]) -> RunConfig:
    """`base` (the profile's model and cache) serving the anchor of `spec` (`anchor_spec`); a
    spec lacking a key is a ValueError naming it. An anchor recorded without its speculation
    (before the record kept it) keeps `base`'s."""
    missing = [k for k in ("scheduler", "workload", "seed") if k not in spec]
    if missing:
        raise ValueError(f"anchor: the profile's anchor lacks {', '.join(missing)}")
    return dataclasses.replace(
        base,
        scheduler=from_dict(SchedulerConfig, spec["scheduler"]),
        workload=from_dict(WorkloadConfig, spec["workload"]),
        spec=from_dict(SpecConfig, spec["spec"]) if "spec" in spec else base.spec,
        seed=int(spec["seed"]),
    )


def time_anchor(serve_makespan: Callable[[], float], runs: int = ANCHOR_RUNS, budget_s: float = ANCHOR_BUDGET_S) -> float:
    """The median of up to `runs` makespans `serve_makespan` returns (each serves the anchor
    once), stopping early once they add up to `budget_s`: a long run is steadier alone."""
    times = [serve_makespan()]
    while len(times) < runs and sum(times) < budget_s:
        times.append(serve_makespan())
    return float(np.median(times))


def anchor_record(spec: dict[str, Any], timings: Sequence[float]) -> dict[str, Any]:
    """The profile's `anchor` entry: the spec, every timing in order and their median (the
    machine speed the profile's fit describes)."""
    return {**spec, "timings_s": [float(t) for t in timings], "reference_s": float(np.median(timings))}


def anchor_speed(before: float, after: float, reference: float) -> float:
    """A run's machine speed against the profile's, from the anchor timings around it: the mean
    of the two over the reference (above 1: the machine ran slower than at the profile)."""
    if reference <= 0:
        raise ValueError(f"anchor: reference_s must be > 0, got {reference!r}")
    return (before + after) / 2 / reference


def on_speed(before: float, after: float, reference: float, tolerance: float = SPEED_TOLERANCE) -> bool:
    """Whether both anchor timings around a run lie within `tolerance` of the reference."""
    return all(abs(t / reference - 1) <= tolerance for t in (before, after))


def steady(record: Optional[dict[str, Any]], tolerance: float = SPEED_TOLERANCE) -> bool:
    """Whether a profile's anchor timings stayed within 2 x `tolerance` of each other (min to max
    over the reference): the machine held one speed while it profiled, so its fit describes one
    machine. A profile without an anchor is not known to be steady."""
    span = spread(record)
    return span is not None and span[1] - span[0] <= 2 * tolerance


def spread(record: Optional[dict[str, Any]]) -> Optional[tuple[float, float]]:
    """(min, max) of a profile's anchor timings over its reference; None without an anchor."""
    if not record or not record.get("timings_s"):
        return None
    ratios = [t / record["reference_s"] for t in record["timings_s"]]
    return min(ratios), max(ratios)
