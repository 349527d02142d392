"""Run every experiment with a `reproduction` section in the simulator; write docs/REPRODUCTIONS.md.

    python experiments/reproduce.py                  # all of configs/experiment/, seeds 0 1 2
    python experiments/reproduce.py --only ltr_toy   # one (others' sections are kept)
    python experiments/reproduce.py --seeds 0 1 2 3  # more seeds (at least 3)

Each row runs at every seed; it passes when it passes at each, its min-max over the seeds is
reported, and a row whose figure moves more than 10% between seeds (an operating point at the
server's saturation edge) is flagged fragile. Rows named in the experiment's `fit_rows` (those
a knob was fitted on) are counted apart from the held-out rest.

Each experiment's outputs go to outputs/reproductions/NAME/seedS/ (summary.json per arm,
comparison.md, reproduction.json). Its rows, setup and notes are kept in
docs/reproductions/NAME.json, from which docs/REPRODUCTIONS.md is rebuilt, with one plot per
figure in docs/reproductions/.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Optional

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run from a checkout without installing
sys.path.insert(0, str(Path(__file__).resolve().parent))

from cbjax.report.files import atomic_write_text, unwritable  # noqa: E402
from cbjax.report.reproduction import evaluate, fit_flags, seed_spread  # noqa: E402
from cbjax.report.tables import format_number, markdown_table, summary_value  # noqa: E402
from plot_reproductions import plot_figure  # noqa: E402

CONFIG_DIR = REPO / "configs"
SEEDS = (0, 1, 2)
MIN_SEEDS = 3
FRAGILE = 0.10  # a row whose figure moves more than this between seeds sits at an edge


def discover(config_dir: Path = CONFIG_DIR) -> list[str]:
    """Names of the experiment configs that have a non-empty experiment.reproduction."""
    names = []
    for path in sorted((config_dir / "experiment").glob("*.yaml")):
        data = yaml.safe_load(path.read_text()) or {}
        if (data.get("experiment") or {}).get("reproduction"):
            names.append(path.stem)
    return names


def compose(name: str, overrides: list[str], config_dir: Path = CONFIG_DIR):
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    from cbjax.app.cli import to_run_config

    with initialize_config_dir(config_dir=str(config_dir), version_base="1.3"):
        return to_run_config(hydra_compose(config_name="config", overrides=[f"experiment={name}", *overrides]))


def setup_text(name: str, cfg, config_dir: Path = CONFIG_DIR) -> str:
    """The experiment file's leading comment, then the resolved setup in one paragraph."""
    lines = (config_dir / "experiment" / f"{name}.yaml").read_text().splitlines()
    comment = []
    for line in lines:
        if not line.startswith("#"):
            break
        if "@package" not in line:
            comment.append(line.lstrip("#").strip())
    w, c, s = cfg.workload, cfg.cache, cfg.scheduler
    sim = (f"simulator, {cfg.executor.cost_model} cost model, overhead={cfg.overhead.name}"
           if cfg.executor.name == "sim" else cfg.executor.name)  # fmt: skip
    arms = "; ".join(f"`{a}`: {_flat(o)}" for a, o in cfg.experiment.arms.items())
    resolved = (
        f"Model `{cfg.model.name}` on `{cfg.hardware.name}` ({sim}); up to {s.max_num_seqs} sequences, "
        f"{s.max_num_batched_tokens} batched tokens; KV pool {c.num_pages} pages of {c.page_size} "
        f"({c.allocation}); workload: {_workload(w)}. Arms: {arms}."
    )
    return " ".join(comment) + ("\n\n" if comment else "") + resolved


def _flat(overrides: dict[str, Any], prefix: str = "") -> str:
    parts = []
    for key, value in overrides.items():
        if isinstance(value, dict):
            parts.append(_flat(value, f"{prefix}{key}."))
        else:
            parts.append(f"{prefix}{key}={value}")
    return ", ".join(parts)


def _workload(w) -> str:
    if w.name == "trace":
        # time_scale divides the trace's arrival times: 3.0 replays it 3x faster
        return f"trace {w.path}" + (f", replayed {w.time_scale:g}x faster" if w.time_scale != 1 else "")
    if w.name == "sessions":  # num_requests does not apply: turns follow from the sessions
        rate = "" if w.arrival == "all_at_once" else f" at {w.rate:g} sessions/s"
        return f"{w.num_sessions} sessions, {w.arrival}{rate}"
    if w.clients:
        clients = ", ".join(f"{c.client_id} at {c.rate:g} req/s" for c in w.clients)
        span = f" for {w.duration_s:g} s" if w.duration_s else ""
        return f"clients {clients} ({w.arrival}){span}"
    rate = "" if w.arrival == "all_at_once" else f" at {w.rate:g} req/s"
    return f"{w.num_requests} requests, {w.arrival}{rate}"


def git_commit(repo: Path = REPO) -> Optional[str]:
    """The checkout's HEAD commit, with "-dirty" when tracked files differ from it; None
    outside a git checkout. Taken before a run writes docs/, so its own output is not counted."""
    try:
        head = subprocess.run(["git", "-C", str(repo), "rev-parse", "HEAD"], capture_output=True, text=True, check=True)
        status = subprocess.run(["git", "-C", str(repo), "status", "--porcelain", "--untracked-files=no"],
                                capture_output=True, text=True, check=True)  # fmt: skip
    except (OSError, subprocess.CalledProcessError):
        return None
    return head.stdout.strip() + ("-dirty" if status.stdout.strip() else "")


def run_one(
    name: str, out_root: Path, overrides: list[str], progress: bool, seeds=SEEDS, commit: Optional[str] = None
) -> dict[str, Any]:
    """Run experiment `name` at every seed; return its record for docs/reproductions/NAME.json.

    The record's `command` is the experiment with the extra `overrides` it ran under (each seed
    adds seed=S) and `commit` the code it ran (`git_commit`).
    A row's `ours`, `arm_values` and plot are the first seed's; `seeds` holds every seed's
    figure and verdict, `verdict` is pass only when every seed passes."""
    from cbjax.app.run import run_experiment

    per_seed, cfg = [], None
    for seed in seeds:
        cfg = compose(name, [f"progress={str(progress).lower()}", *overrides, f"seed={seed}"])
        summaries = run_experiment(cfg, out_root / name / f"seed{seed}", verbose=False)
        per_seed.append((evaluate(cfg.experiment.reproduction, summaries), summaries))
    entries = cfg.experiment.reproduction
    fitted = fit_flags(entries, cfg.experiment.fit_rows, where=f"{name}: experiment.fit_rows")
    rows = []
    for i, (entry, fit) in enumerate(zip(entries, fitted)):
        arms = [a for a in (entry.get("arm"), entry.get("ratio_to")) if a] + list(entry.get("arms") or [])
        seed_rows = [rs[i] for rs, _ in per_seed]
        row = dict(seed_rows[0])
        row["kind"] = entry.get("kind") or "value"
        row["arm_values"] = {a: summary_value(per_seed[0][1][a], row["metric"]) for a in arms}
        if entry.get("paper_set"):  # argmin_in: the plot marks these arms
            row["paper_set"] = list(entry["paper_set"])
        row["fit"] = fit
        row["seeds"] = {str(s): {"ours": r["ours"], "verdict": r["verdict"]} for s, r in zip(seeds, seed_rows)}
        row["passes"] = sum(r["verdict"] == "pass" for r in seed_rows)
        row["verdict"] = "pass" if row["passes"] == len(seeds) else "fail"
        if row["kind"] in ("value", "exact", "best_of"):
            figures = {"ours": [r["ours"] for r in seed_rows]}
        else:  # an ordering or argmin moves with its arms
            figures = {a: [summary_value(s[a], row["metric"]) for _, s in per_seed] for a in arms}
        spreads = [seed_spread(v) for v in figures.values()]
        row["seed_spread"] = None if None in spreads else max(spreads)
        numeric = figures.get("ours")
        row["range"] = [min(numeric), max(numeric)] if numeric and None not in numeric else None
        row["fragile"] = row["seed_spread"] is None or row["seed_spread"] > FRAGILE or 0 < row["passes"] < len(seeds)
        rows.append(row)
    return {
        "name": name,
        "command": " ".join([f"cbjax experiment={name}", *overrides]),
        "commit": commit,
        "seeds": list(seeds),
        "setup": setup_text(name, cfg),
        "notes": cfg.experiment.notes.strip(),
        "rows": rows,
        "series": _client_series(out_root / name / f"seed{seeds[0]}", cfg),
    }


def _client_series(out_dir: Path, cfg) -> dict[str, dict[str, list[list[float]]]]:
    """Per arm and client, [bin end, service per second] from client_service.csv, when a row
    compares client service."""
    if not any(str(e.get("metric", "")).startswith("client_service.") for e in cfg.experiment.reproduction):
        return {}
    import csv

    series: dict[str, dict[str, list[list[float]]]] = {}
    for arm in cfg.experiment.arms:
        with open(out_dir / arm / "client_service.csv") as f:
            for r in csv.DictReader(f):
                point = [float(r["t_end_s"]), round(float(r["service_per_s"]), 3)]
                series.setdefault(arm, {}).setdefault(r["client_id"], []).append(point)
    return series


def _dumps(record: dict[str, Any]) -> str:
    """Indented JSON with each [t, rate] point of a series on one line."""
    text = json.dumps(record, indent=2)
    return re.sub(r"\[\s+([-\d.e+]+),\s+([-\d.e+]+)\s+\]", r"[\1, \2]", text) + "\n"


def slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "_", text.lower()).strip("_") or "figure"


def _passes(rows: list[dict[str, Any]], fit: bool) -> tuple[Any, Any]:
    """(passing at every seed, total) among the fitted (or held-out) rows; "-" if none."""
    chosen = [r for r in rows if bool(r.get("fit")) == fit]
    return (sum(r["verdict"] == "pass" for r in chosen), len(chosen)) if chosen else ("-", "-")


def _range(r: dict[str, Any]) -> str:
    if r.get("range"):
        lo, hi = r["range"]
        return format_number(lo) if lo == hi else f"{format_number(lo)}-{format_number(hi)}"
    return "; ".join(f"{s}: {v['verdict']}" for s, v in (r.get("seeds") or {}).items()) or "-"


def render(records: list[dict[str, Any]], docs_dir: Path) -> str:
    """docs/REPRODUCTIONS.md's text; writes one plot per figure under docs_dir/reproductions."""
    plots_dir = docs_dir / "reproductions"
    seeds = sorted({s for r in records for s in r.get("seeds", [])})
    lines = [
        "# Paper reproductions",
        "",
        "Generated by `python experiments/reproduce.py` (all in the simulator); rerun one with",
        "`--only NAME`. Each experiment is also `cbjax experiment=NAME`, which writes",
        "`reproduction.json` beside its arms' outputs. A value passes within its relative",
        "tolerance of the paper's number; `exact` means equal at the paper's printed precision;",
        "an ordering passes when ours is strictly ascending in the paper's order; `argmin_in`",
        "when our lowest arm is among the paper's best; `best_of` when an arm is within its tolerance",
        "of the lowest of the arms it is held against.",
        "",
        f"Every row runs at seeds {', '.join(map(str, seeds))}; it passes only when it passes at every seed. "
        "`ours` is the first seed's figure, `seeds` its min-max over the seeds. A row whose figure (or, for an "
        f"ordering, any arm's) moves more than {FRAGILE:.0%} between seeds, or that passes at some seeds only, "
        "sits at an operating edge and is flagged **fragile**.",
        "",
        "Each experiment names its serving-stack overhead (`overhead=`, configs/overhead/: what each was fitted on "
        "and its source) and declares its `fit_rows`, the rows any knob was fitted or chosen on. Those rows are "
        "counted as **fitted**: they show that a knob can account for a gap, not that the simulator predicts them. "
        "Every other row is **held out**, and only held-out passes are evidence.",
        "",
    ]
    overview = [[f"[{r['name']}](#{slug(r['name'])})", *_passes(r["rows"], False), *_passes(r["rows"], True),
                 sum(bool(x.get("fragile")) for x in r["rows"])] for r in records]  # fmt: skip
    head = ["experiment", "pass (held out)", "rows (held out)", "pass (fitted)", "rows (fitted)", "fragile rows"]
    lines += [markdown_table(head, overview), ""]
    for rec in records:
        ran = f"`{rec['command']}`" + (f" at commit {rec['commit']}" if rec.get("commit") else "")
        lines += [f"## {rec['name']}", "", ran, "", "**Setup.** " + rec["setup"], ""]
        cells = [
            [r["figure"], r["setting"], r["metric"], format_number(r["paper"]), format_number(r["ours"]), _range(r),
             "-" if r["tolerance"] is None else f"±{r['tolerance']:.0%}",
             f"{r['verdict']} ({r.get('passes', '-')}/{len(r.get('seeds') or {})})",
             "fitted" if r.get("fit") else "held out", "fragile" if r.get("fragile") else ""]
            for r in rec["rows"]
        ]  # fmt: skip
        head = ["figure", "setting", "metric", "paper", "ours", "seeds", "tolerance", "verdict (seeds)", "row", "edge"]
        lines += [markdown_table(head, cells), ""]
        figures = list(dict.fromkeys(r["figure"] for r in rec["rows"]))
        for figure in figures:
            rows = [r for r in rec["rows"] if r["figure"] == figure]
            path = plots_dir / f"{slug(rec['name'])}__{slug(figure)}.png"
            plot_figure(path, f"{figure} ({rec['name']})", rows, rec.get("series") or {})
            lines += [f"![{figure}](reproductions/{path.name})", ""]
        if rec["notes"]:
            lines += ["**Modelling differences and notes.** " + " ".join(rec["notes"].split()), ""]
    rows = [x for r in records for x in r["rows"]]
    held = [x for x in rows if not x.get("fit")]
    fit = [x for x in rows if x.get("fit")]
    fragile = [x for x in rows if x.get("fragile")]
    lines += [
        "## Summary",
        "",
        f"Held out: {sum(x['verdict'] == 'pass' for x in held)} of {len(held)} rows pass at every seed. "
        f"Fitted: {sum(x['verdict'] == 'pass' for x in fit)} of {len(fit)} (not evidence: a knob was chosen on them). "
        f"Fragile: {len(fragile)} rows move more than {FRAGILE:.0%} between seeds or pass at some seeds only "
        f"({sum(x['verdict'] == 'pass' for x in fragile)} of them pass at every seed).",
        "",
    ]
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", action="append", metavar="NAME", help="run only this experiment (repeatable)")
    parser.add_argument("--out", type=Path, default=REPO / "outputs" / "reproductions", help="run outputs")
    parser.add_argument("--docs", type=Path, default=REPO / "docs", help="where REPRODUCTIONS.md goes")
    parser.add_argument("--no-progress", action="store_true", help="no per-run progress bars")
    parser.add_argument("--seeds", type=int, nargs="+", default=list(SEEDS), help=f"at least {MIN_SEEDS} seeds")
    parser.add_argument("overrides", nargs="*", help="extra overrides for every experiment (e.g. seed=1)")
    args = parser.parse_args(argv)
    if len(set(args.seeds)) < MIN_SEEDS:
        parser.error(f"--seeds: every row runs over at least {MIN_SEEDS} distinct seeds, got {args.seeds}")
    names = discover()
    if args.only:
        unknown = [n for n in args.only if n not in names]
        if unknown:
            parser.error(f"--only: {unknown} have no reproduction section; choose from {names}")
        names = [n for n in names if n in args.only]
    store = args.docs / "reproductions"
    for flag, folder in (("--out", args.out), ("--docs", store)):
        if problem := unwritable(folder):  # found now, not after the runs
            parser.error(f"{flag}: {problem}")
    t_all = time.perf_counter()
    commit = git_commit()  # before the first record is written
    for i, name in enumerate(names, 1):
        print(f"[{i}/{len(names)}] {name} ...", flush=True)
        t0 = time.perf_counter()
        record = run_one(name, args.out, args.overrides, progress=not args.no_progress and sys.stderr.isatty(),
                         seeds=tuple(args.seeds), commit=commit)  # fmt: skip
        atomic_write_text(store / f"{name}.json", _dumps(record))  # whole or absent: the next run reads them all
        passed = sum(r["verdict"] == "pass" for r in record["rows"])
        fragile = sum(r["fragile"] for r in record["rows"])
        print(f"[{i}/{len(names)}] {name}: {passed}/{len(record['rows'])} pass at every seed, {fragile} fragile, "
              f"in {time.perf_counter() - t0:.1f} s", flush=True)  # fmt: skip
    records = [json.loads(p.read_text()) for p in sorted(store.glob("*.json")) if p.stem in discover()]
    atomic_write_text(args.docs / "REPRODUCTIONS.md", render(records, args.docs))
    rows = [x for r in records for x in r["rows"]]
    held = [x for x in rows if not x.get("fit")]
    print(f"held out: {sum(x['verdict'] == 'pass' for x in held)}/{len(held)} pass; fitted: "
          f"{sum(x['verdict'] == 'pass' for x in rows if x.get('fit'))}/{len(rows) - len(held)}; "
          f"wrote {args.docs / 'REPRODUCTIONS.md'} in {time.perf_counter() - t_all:.1f} s")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
