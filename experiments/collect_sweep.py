"""Collect a sweep's summary.json files into one CSV, a markdown table and a plot of one metric.

Reads any Hydra sweep dir (basic or joblib launchers, Slurm or Ray jobs, optuna trials: the
study's best from optimization_results.yaml goes above the table), a run dir or an experiment.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Optional

import yaml

from cbjax.report.files import unwritable
from cbjax.report.tables import format_number, markdown_table

DEFAULT_METRICS = (
    "throughput_tok_s",
    "throughput_req_s",
    "ttft_s_p50",
    "ttft_s_p99",
    "tpot_s_p50",
    "e2e_s_p50",
    "e2e_s_p99",
    "slot_utilization",
    "mean_batch_size",
    "preemptions",
)
# Tracking stores (logger=...) and hidden dirs (.hydra, .submitit) hold copies, not jobs.
STORE_DIRS = ("mlruns", "tensorboard", "wandb")


@dataclass
class Job:
    path: Path
    labels: dict[str, str]  # override key -> value as typed on the command line; or arm / run name
    summary: dict[str, Any]


def parse_overrides(path: Path) -> dict[str, str]:
    """Hydra's overrides.yaml as key -> value, leaving out hydra.* and progress."""
    labels = {}
    for item in yaml.safe_load(path.read_text()) or []:
        key, _, value = str(item).partition("=")
        key = key.lstrip("+~")
        if not key.startswith("hydra.") and key != "progress":
            labels[key] = value
    return labels


def _up_to(path: Path, root: Path) -> Iterator[Path]:
    yield path
    while path != root and path.parent != path:
        path = path.parent
        yield path


def job_labels(job_dir: Path, root: Path) -> dict[str, str]:
    """Overrides of the nearest Hydra job at or above `job_dir`; an arm subdir below it adds `arm`."""
    base = next((d for d in _up_to(job_dir, root) if (d / ".hydra" / "overrides.yaml").is_file()), None)
    labels = parse_overrides(base / ".hydra" / "overrides.yaml") if base else {}
    arm = job_dir.relative_to(base or root).as_posix()
    if arm != ".":
        labels["arm"] = arm
    return labels or {"run": job_dir.name}


def _number(value: Optional[str]) -> Optional[float]:
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


def _sort_key(values: list[Optional[str]]) -> tuple:
    # numbers before words, numbers by value: rate=2 sorts before rate=10
    return tuple(
        (2, 0.0, "") if v is None else (0, n, "") if (n := _number(v)) is not None else (1, 0.0, v) for v in values
    )


def _in_store(rel: Path) -> bool:
    return any(part in STORE_DIRS or part.startswith(".") for part in rel.parts[:-1])


def find_jobs(root: Path) -> tuple[list[Job], list[str]]:
    """Every dir under `root` (itself included) with a summary.json, sorted by its labels; and the label columns."""
    if not root.is_dir():
        raise ValueError(f"{root}: not a directory")
    root = root.resolve()
    paths = sorted(p for p in root.rglob("summary.json") if not _in_store(p.relative_to(root)))
    jobs = [Job(p.parent, job_labels(p.parent, root), json.loads(p.read_text())) for p in paths]
    if not jobs:
        raise ValueError(f"{root}: no summary.json found (expected a sweep dir, a run dir or an experiment dir)")
    columns = list(dict.fromkeys(k for j in jobs for k in j.labels))
    jobs.sort(key=lambda j: _sort_key([j.labels.get(c) for c in columns]))
    return jobs, columns


def varying(jobs: list[Job], columns: list[str]) -> list[str]:
    """The label columns that differ between jobs (all of them when none do)."""
    return [c for c in columns if len({j.labels.get(c) for j in jobs}) > 1] or columns


def optimized_metric(jobs: list[Job]) -> Optional[str]:
    """The optimized_metric a sweeper's jobs returned, from a job's saved Hydra config."""
    for job in jobs:
        path = job.path / ".hydra" / "config.yaml"
        if path.is_file():
            return (yaml.safe_load(path.read_text()) or {}).get("optimized_metric")
    return None


def optuna_best(root: Path) -> Optional[str]:
    """A line on the study's best trial (or Pareto front) from optuna's optimization_results.yaml."""
    path = root / "optimization_results.yaml"
    if not path.is_file():
        return None
    results = yaml.safe_load(path.read_text()) or {}
    params = lambda p: ", ".join(f"{k}={v}" for k, v in p.items())  # noqa: E731
    if "best_params" in results:
        return f"optuna best: {format_number(results.get('best_value'))} at {params(results['best_params'])}"
    solutions = results.get("solutions") or []
    front = "; ".join(f"{s.get('values')} at {params(s.get('params', {}))}" for s in solutions)
    return f"optuna Pareto front ({len(solutions)}): {front}"


def check_metrics(jobs: list[Job], names: Optional[list[str]]) -> list[str]:
    available = sorted(set().union(*(j.summary for j in jobs)))
    if names is None:
        target = optimized_metric(jobs)
        first = [target] if target in available else []
        return first + [m for m in DEFAULT_METRICS if m in available and m not in first]
    unknown = [m for m in names if m not in available]
    if unknown:
        raise ValueError(f"unknown metric {', '.join(unknown)}; summary.json keys are: {', '.join(available)}")
    return names


def format_markdown(jobs: list[Job], columns: list[str], metrics: list[str]) -> str:
    """Varying labels then metrics, one row per job; labels shared by every job go on one line above."""
    shown = varying(jobs, columns)
    fixed = [f"{c}={jobs[0].labels[c]}" for c in columns if c not in shown]
    rows = [[j.labels.get(c, "-") for c in shown] + [format_number(j.summary.get(m)) for m in metrics] for j in jobs]
    table = markdown_table([*shown, *metrics], rows)
    return (f"fixed: {', '.join(fixed)}\n\n" if fixed else "") + table


def write_csv(path: Path, jobs: list[Job], columns: list[str], metrics: list[str]) -> None:
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow([*columns, *metrics])
        for j in jobs:
            writer.writerow([j.labels.get(c, "") for c in columns] + [j.summary.get(m) for m in metrics])


def default_x(jobs: list[Job], columns: list[str]) -> Optional[str]:
    """The first varying label whose values are all numbers, else the first varying label."""
    shown = varying(jobs, columns)
    numeric = [c for c in shown if all(_number(j.labels.get(c)) is not None for j in jobs)]
    return (numeric or shown or [None])[0]


def plot(path: Path, jobs: list[Job], columns: list[str], x: Optional[str], y: str) -> None:
    """y against a numeric x, one line per combination of the other labels; grouped bars if x is not numeric."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    others = [c for c in varying(jobs, columns) if c != x]
    groups: dict[tuple, list[Job]] = {}
    for j in jobs:
        groups.setdefault(tuple(j.labels.get(c, "-") for c in others), []).append(j)
    legend = lambda key: ", ".join(f"{c}={v}" for c, v in zip(others, key)) or None  # noqa: E731
    value = lambda j: math.nan if j.summary.get(y) is None else j.summary[y]  # noqa: E731

    fig, ax = plt.subplots(figsize=(7, 4.5))
    if x is not None and all(_number(j.labels.get(x)) is not None for j in jobs):
        for key, members in groups.items():
            members = sorted(members, key=lambda j: _number(j.labels[x]))
            ax.plot([_number(j.labels[x]) for j in members], [value(j) for j in members], marker="o", label=legend(key))
    else:
        categories = list(dict.fromkeys(j.labels.get(x, "-") for j in jobs)) if x else [""]
        width = 0.8 / len(groups)
        for i, (key, members) in enumerate(groups.items()):
            by_category = {j.labels.get(x, "-") if x else "": value(j) for j in members}
            offset = (i - (len(groups) - 1) / 2) * width
            heights = [by_category.get(c, math.nan) for c in categories]
            ax.bar([k + offset for k in range(len(categories))], heights, width, label=legend(key))
        ax.set_xticks(range(len(categories)), categories)
    ax.set_xlabel(x or "")
    ax.set_ylabel(y)
    ax.set_title(f"{y} vs {x}" if x else y)
    ax.grid(alpha=0.3)
    if len(groups) > 1:
        ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def collect(
    sweep_dir: Path,
    metrics: Optional[list[str]] = None,
    x: Optional[str] = None,
    y: str = "throughput_tok_s",
    out: Optional[Path] = None,
) -> str:
    """Write <out>.csv, <out>.md and <out>.png for the sweep; return the markdown."""
    jobs, columns = find_jobs(sweep_dir)
    # A run stopped by a signal (Ctrl-C, a Slurm timeout) saved figures of part of its workload:
    # they are not comparable with finished jobs, so they stay out of the table and the plot.
    partial = [j for j in jobs if j.summary.get("interrupted")]
    jobs = [j for j in jobs if not j.summary.get("interrupted")]
    if not jobs:
        raise ValueError(f"{sweep_dir}: every run was interrupted ({len(partial)}); rerun the sweep to finish them")
    metrics = check_metrics(jobs, metrics)
    check_metrics(jobs, [y])
    if x is not None and x not in columns:
        raise ValueError(f"--x {x}: not an override key; keys are: {', '.join(columns)}")
    x = x or default_x(jobs, columns)
    out = out or sweep_dir / "sweep"
    out.parent.mkdir(parents=True, exist_ok=True)
    text = format_markdown(jobs, columns, metrics)
    if partial:
        names = ", ".join(j.path.relative_to(sweep_dir.resolve()).as_posix() for j in partial)
        text = f"left out {len(partial)} interrupted (partial) runs, which a rerun of the sweep finishes: {names}\n\n{text}"
    best = optuna_best(sweep_dir)
    if best:
        text = f"{best}\n\n{text}"
    write_csv(Path(f"{out}.csv"), jobs, columns, metrics)
    Path(f"{out}.md").write_text(f"# {sweep_dir}\n\n{text}\n")
    plot(Path(f"{out}.png"), jobs, columns, x, y)
    return text


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("sweep_dir", type=Path, help="a multirun dir, a single run dir or an experiment dir")
    parser.add_argument("--metrics", help=f"comma-separated summary.json keys (default: {','.join(DEFAULT_METRICS)})")
    parser.add_argument("--x", help="override key for the plot's x axis (default: the first numeric one)")
    parser.add_argument("--y", default="throughput_tok_s", help="metric to plot (default: throughput_tok_s)")
    parser.add_argument("--out", type=Path, help="output prefix for .csv/.md/.png (default: SWEEP_DIR/sweep)")
    args = parser.parse_args(argv)
    metrics = [m.strip() for m in args.metrics.split(",") if m.strip()] if args.metrics else None
    if args.out is not None and (problem := unwritable(args.out.resolve().parent)):
        parser.error(f"--out: {problem}")
    try:
        text = collect(args.sweep_dir, metrics, args.x, args.y, args.out)
    except ValueError as err:
        print(f"collect_sweep: error: {err}", file=sys.stderr)
        return 2
    out = args.out or args.sweep_dir / "sweep"
    print(text)
    print(f"\nwrote {out}.csv, {out}.md, {out}.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
