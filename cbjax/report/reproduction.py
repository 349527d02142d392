"""Published numbers beside ours: checks `experiment.reproduction` and writes reproduction.json.

Each entry of `experiment.reproduction` compares one published result with the arms'
summaries:

    figure: "vLLM Fig 2"          free text
    setting: "Orca (Max)"         free text
    metric: kv_share_token_states a summary.json key; `a.b` reads summary["a"]["b"]
                                  (client_service.<client_id>)
    kind: value                   value (default) | exact | ordering | argmin_in
    value, exact:
      arm: orca_max               ours = that arm's summary[metric]
      ratio_to: null              an arm: ours = arm's metric / ratio_to's metric
      paper: 0.204                a number
      tolerance: 0.15             value: pass when |ours - paper| <= tolerance * |paper|
                                  (default 0.15). exact: pass when ours, rounded to as many
                                  decimals as the paper prints, equals it.
    ordering:
      arms: [a, b, c]             in the paper's ascending order of metric: pass when ours
                                  is strictly ascending in the same order
    argmin_in:
      arms: [a, b, c]             the arms compared
      paper_set: [b, c]           pass when the arm with our lowest metric is one of these
    best_of:
      arm: adaptive               ours = that arm's metric / the lowest of `arms`' metrics
      arms: [a, b, c]             the arms it is held against (lower is better)
      tolerance: 0.05             pass when ours <= 1 + tolerance (default 0.15)
    paper (ordering, argmin_in,   optional text for the table (default: from arms/paper_set)
           best_of)

Rows of reproduction.json: {figure, setting, metric, paper, ours, tolerance, verdict}, verdict
"pass" or "fail" (ours None: a missing or undefined metric, which fails).
"""

from __future__ import annotations

import json
import math
from decimal import Decimal
from pathlib import Path
from typing import Any, Iterable, Optional

from cbjax.report.tables import format_number, markdown_table, summary_value

KINDS = ("value", "exact", "ordering", "argmin_in", "best_of")
COMMON_KEYS = ("figure", "setting", "metric", "kind")
KIND_KEYS = {
    "value": ("arm", "ratio_to", "paper", "tolerance"),
    "exact": ("arm", "ratio_to", "paper"),
    "ordering": ("arms", "paper"),
    "argmin_in": ("arms", "paper_set", "paper"),
    "best_of": ("arm", "arms", "tolerance", "paper"),
}
REQUIRED = {"value": ("arm", "paper"), "exact": ("arm", "paper"), "ordering": ("arms",), "argmin_in": ("arms", "paper_set"),
            "best_of": ("arm", "arms")}  # fmt: skip
ALL_KEYS = set(COMMON_KEYS).union(*KIND_KEYS.values())
DEFAULT_TOLERANCE = 0.15
ROW_KEYS = ("figure", "setting", "metric", "paper", "ours", "tolerance", "verdict")


def check_entries(entries: list[dict[str, Any]], arm_metrics: dict[str, set[str]]) -> None:
    """Raise ValueError naming the entry for an unknown key, kind, arm or metric.

    `arm_metrics` maps each arm to the summary keys its runs will have.
    """
    for i, entry in enumerate(entries):
        where = f"experiment.reproduction[{i}]"
        if not isinstance(entry, dict):
            raise ValueError(f"{where}: must be a mapping, got {entry!r}")
        unknown = sorted(set(entry) - ALL_KEYS)
        if unknown:
            raise ValueError(f"{where}: unknown keys {unknown}; allowed: {', '.join(sorted(ALL_KEYS))}")
        kind = entry.get("kind") or "value"
        if kind not in KINDS:
            raise ValueError(f"{where}.kind: unknown value {kind!r}; choose one of {', '.join(KINDS)}")
        extra = sorted(k for k in entry if k not in COMMON_KEYS and k not in KIND_KEYS[kind] and entry[k] is not None)
        if extra:
            raise ValueError(f"{where}: keys {extra} do not apply to kind {kind}")
        for key in ("metric",) + REQUIRED[kind]:
            if entry.get(key) in (None, "", []):
                raise ValueError(f"{where}: {key} is required for kind {kind}")
        if kind in ("value", "exact") and not _is_number(entry["paper"]):
            raise ValueError(f"{where}.paper: must be a number for kind {kind}, got {entry['paper']!r}")
        tolerance = entry.get("tolerance")
        if tolerance is not None and not (_is_number(tolerance) and tolerance >= 0):
            raise ValueError(f"{where}.tolerance: must be a number >= 0, got {tolerance!r}")
        arms = [entry[k] for k in ("arm", "ratio_to") if entry.get(k) is not None]
        for key in ("arms", "paper_set"):
            if key in entry and entry[key] is not None:
                if not isinstance(entry[key], (list, tuple)) or not entry[key]:
                    raise ValueError(f"{where}.{key}: must be a non-empty list of arm names, got {entry[key]!r}")
                arms += list(entry[key])
        if kind == "ordering" and len(entry["arms"]) < 2:
            raise ValueError(f"{where}.arms: an ordering needs at least two arms, got {entry['arms']!r}")
        for arm in arms:
            if arm not in arm_metrics:
                raise ValueError(f"{where}: unknown arm {arm!r}; arms are {list(arm_metrics)}")
        head = str(entry["metric"]).split(".", 1)[0]
        for arm in arms if kind == "best_of" else entry.get("arms") or arms:
            if head not in arm_metrics[arm]:
                raise ValueError(f"{where}.metric: {entry['metric']!r} is not a summary.json key of arm {arm!r}")


def fit_flags(entries: list[dict[str, Any]], fit_rows: list[str], where: str = "experiment.fit_rows") -> list[bool]:
    """Per entry, whether a knob was fitted on it: its `setting` is one of `fit_rows`. Raise
    ValueError naming a fit row that matches no entry's setting, or more than one."""
    settings = [str(e.get("setting", "")) for e in entries]
    for i, name in enumerate(fit_rows):
        count = settings.count(name)
        if count != 1:
            found = "no row" if count == 0 else f"{count} rows"
            raise ValueError(f"{where}[{i}]: {name!r} names {found}; a fit row is one reproduction entry's setting")
    return [s in fit_rows for s in settings]


def seed_spread(values: list[Optional[float]]) -> Optional[float]:
    """(max - min) / |median| of one figure over seeds; None when a value is missing or the median is 0."""
    if not values or any(v is None for v in values):
        return None
    ordered = sorted(values)
    mid = len(ordered) // 2
    median = ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2
    return (ordered[-1] - ordered[0]) / abs(median) if median else None


def lookup(summary: dict[str, Any], metric: str) -> Optional[float]:
    """summary[metric], following dots into nested mappings; None when absent."""
    value = summary_value(summary, metric)
    return value if _is_number(value) else None


def evaluate(entries: list[dict[str, Any]], summaries: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per entry: the paper's number, ours and the verdict."""
    return [_row(entry, summaries) for entry in entries]


def _row(entry: dict[str, Any], summaries: dict[str, dict[str, Any]]) -> dict[str, Any]:
    kind = entry.get("kind") or "value"
    metric = str(entry["metric"])
    row = {"figure": entry.get("figure", ""), "setting": entry.get("setting", ""), "metric": metric}
    if kind in ("value", "exact"):
        ours = lookup(summaries[entry["arm"]], metric)
        if entry.get("ratio_to") is not None:
            base = lookup(summaries[entry["ratio_to"]], metric)
            ours = ours / base if ours is not None and base else None
        paper = entry["paper"]
        if kind == "value":
            tolerance = entry.get("tolerance")
            tolerance = DEFAULT_TOLERANCE if tolerance is None else tolerance
            ok = ours is not None and abs(ours - paper) <= tolerance * abs(paper) + 1e-12
        else:
            tolerance = None
            ok = ours is not None and abs(ours - paper) <= _half_last_digit(paper) * (1 + 1e-9)
        return {**row, "paper": paper, "ours": ours, "tolerance": tolerance, "verdict": _verdict(ok)}
    if kind == "best_of":
        tolerance = entry.get("tolerance")
        tolerance = DEFAULT_TOLERANCE if tolerance is None else tolerance
        values = [lookup(summaries[arm], metric) for arm in entry["arms"]]
        ours = lookup(summaries[entry["arm"]], metric)
        best = min(values) if None not in values else None
        ours = ours / best if ours is not None and best else None
        ok = ours is not None and ours <= 1 + tolerance + 1e-12
        paper = entry.get("paper") or f"{entry['arm']} <= the best of {{{', '.join(entry['arms'])}}}"
        return {**row, "paper": paper, "ours": ours, "tolerance": tolerance, "verdict": _verdict(ok)}
    arms = list(entry["arms"])
    values = {arm: lookup(summaries[arm], metric) for arm in arms}
    if any(v is None for v in values.values()):
        ours, ok = None, False
    elif kind == "ordering":
        ours = " < ".join(f"{a} ({format_number(values[a])})" for a in sorted(arms, key=values.__getitem__))
        ok = all(values[a] < values[b] for a, b in zip(arms, arms[1:]))
    else:
        best = min(arms, key=values.__getitem__)
        ours = f"{best} ({format_number(values[best])})"
        ok = best in entry["paper_set"]
    paper = entry.get("paper")
    if paper is None:
        paper = " < ".join(arms) if kind == "ordering" else "lowest in {" + ", ".join(entry["paper_set"]) + "}"
    return {**row, "paper": paper, "ours": ours, "tolerance": None, "verdict": _verdict(ok)}


def format_rows(rows: Iterable[dict[str, Any]]) -> str:
    """A markdown table of the rows."""
    header = ["figure", "setting", "metric", "paper", "ours", "tolerance", "verdict"]
    cells = []
    for r in rows:
        tol = "-" if r["tolerance"] is None else f"±{r['tolerance']:.0%}"
        cells.append([r["figure"], r["setting"], r["metric"], format_number(r["paper"]), format_number(r["ours"]), tol,
                      r["verdict"]])  # fmt: skip
    return markdown_table(header, cells)


def write_reproduction(out_dir: Path, rows: list[dict[str, Any]]) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "reproduction.json"
    path.write_text(json.dumps([{k: r[k] for k in ROW_KEYS} for r in rows], indent=2) + "\n")
    return path


def _half_last_digit(paper: float) -> float:
    """Half a unit in the paper's last printed decimal: 6.67 -> 0.005, 7 -> 0.5."""
    exponent = Decimal(repr(paper)).normalize().as_tuple().exponent
    return 0.5 * 10.0 ** min(0, int(exponent))


def _is_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _verdict(ok: bool) -> str:
    return "pass" if ok else "fail"
