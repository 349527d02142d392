"""Run outputs: summary.json, requests.jsonl, config.yaml, and readable tables."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, Iterable, Optional

import yaml

from cbjax.report.metrics import request_row
from cbjax.report.files import OutputError, atomic_write_text
from cbjax.core.request import Request
from cbjax.spec.trace import TRACE_FILE, trace_lines

SUMMARY_ROWS = (
    ("requests (finished / rejected)", lambda s: f"{s['num_requests']} ({s['num_finished']} / {s['num_rejected']})"),
    ("iterations", lambda s: f"{s['iterations']}"),
    ("makespan", lambda s: f"{s['makespan_s']:.3f} s"),
    ("throughput", lambda s: f"{s['throughput_tok_s']:.1f} tok/s, {s['throughput_req_s']:.3f} req/s"),
    ("TTFT p50 / p90 / p99", lambda s: _triple(s, "ttft_s")),
    ("TPOT p50 / p90 / p99", lambda s: _triple(s, "tpot_s")),
    ("e2e p50 / p90 / p99", lambda s: _triple(s, "e2e_s")),
    ("slot utilization", lambda s: f"{s['slot_utilization']:.1%}"),
    ("batch size mean / peak", lambda s: f"{s['mean_batch_size']:.1f} / {s['peak_batch_size']}"),
    ("KV pages mean / peak", lambda s: f"{s['kv_pages_used_mean']:.1f} / {s['kv_pages_used_peak']}"),
    ("KV token utilization", lambda s: f"{s['kv_token_utilization']:.1%}"),
    ("preemptions (by swap)", lambda s: f"{s['preemptions']} ({s.get('swap_preemptions', 0)})"),
    ("prefix cache hit rate", lambda s: f"{s.get('prefix_cache_hit_rate', 0.0):.1%}"),
    ("wall time", lambda s: f"{s['wall_s']:.2f} s"),
)


# shown when the run speculated (summary.json has its spec fields)
SPEC_ROWS = (
    ("drafts accepted / proposed", lambda s: f"{s['spec_accepted_tokens']} / {s['spec_proposed_tokens']} "
                                             f"({_pct(s['spec_acceptance_rate'])})"),
    ("tokens per verification", lambda s: _fmt(s["spec_mean_accepted_per_step"])),
    ("tokens per iteration", lambda s: _fmt(s["tokens_per_iteration"])),
)  # fmt: skip


def _pct(x: Optional[float]) -> str:
    return "-" if x is None else f"{x:.1%}"


def _fmt(x: Optional[float]) -> str:
    return "-" if x is None else f"{x:.3f}"


def _triple(s: dict[str, Any], key: str) -> str:
    return " / ".join(_fmt(s.get(f"{key}_p{p}")) for p in (50, 90, 99)) + " s"


def format_summary(summary: dict[str, Any], title: str = "run") -> str:
    rows = [(name, fn(summary)) for name, fn in SUMMARY_ROWS]
    if "spec_acceptance_rate" in summary:
        rows += [(name, fn(summary)) for name, fn in SPEC_ROWS]
    return markdown_table(["metric", title], rows)


def markdown_table(header: list[str], rows: Iterable[Iterable[Any]]) -> str:
    rows = [[str(c) for c in r] for r in rows]
    widths = [max(len(str(h)), *(len(r[i]) for r in rows)) if rows else len(str(h)) for i, h in enumerate(header)]
    line = lambda cells: "| " + " | ".join(c.ljust(w) for c, w in zip(cells, widths)) + " |"  # noqa: E731
    sep = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    return "\n".join([line([str(h) for h in header]), sep, *(line(r) for r in rows)])


TABLE_KEYS = ("title", "arms", "metrics")


def check_tables(tables: list[Any], arms: Iterable[str], arm_metrics: dict[str, Optional[set[str]]]) -> None:
    """Raise ValueError naming the table for a missing or unknown key, an unknown arm or an
    unknown metric, before any arm runs. `arm_metrics` maps an arm to the summary keys its run
    will have, or None where they are not known ahead (an engine adds counters of its own). A
    metric must be in some arm's summary (a baseline arm may lack it: its cell shows "-"); a
    dotted metric is checked by its first part (`client_service.<client_id>`)."""
    arms = list(arms)
    for i, table in enumerate(tables):
        where = f"experiment.tables[{i}]"
        if not isinstance(table, dict):
            raise ValueError(f"{where}: must be a mapping {{title, arms, metrics}}, got {table!r}")
        unknown = sorted(set(table) - set(TABLE_KEYS))
        if unknown:
            raise ValueError(f"{where}: unknown keys {unknown}; allowed: {', '.join(TABLE_KEYS)}")
        for key in TABLE_KEYS:
            if table.get(key) in (None, "", []):
                raise ValueError(f"{where}.{key} is required")
        for key in ("arms", "metrics"):
            if not isinstance(table[key], (list, tuple)):
                raise ValueError(f"{where}.{key}: must be a list, got {table[key]!r}")
        missing = [a for a in table["arms"] if a not in arms]
        if missing:
            raise ValueError(f"{where}: unknown arms {missing}; arms are {arms}")
        known = [arm_metrics.get(a) for a in table["arms"]]
        if any(keys is None for keys in known):
            continue
        keys = set().union(*known)
        bad = [m for m in table["metrics"] if m not in keys and str(m).split(".")[0] not in keys]
        if bad:
            raise ValueError(f"{where}.metrics: {bad} are in no summary.json of arms {list(table['arms'])}")


def comparison_table(title: str, arms: list[str], metrics: list[str], summaries: dict[str, dict[str, Any]]) -> str:
    """Metrics side by side, with each arm's ratio to the first arm."""
    base = arms[0]
    header = ["metric", *arms, *(f"{a} / {base}" for a in arms[1:])]
    rows = []
    for m in metrics:
        vals = [summary_value(summaries[a], m) for a in arms]
        cells = [m, *(format_number(v) for v in vals)]
        for v in vals[1:]:
            b = vals[0]
            cells.append(f"{v / b:.2f}x" if isinstance(v, (int, float)) and isinstance(b, (int, float)) and b else "-")
        rows.append(cells)
    return f"### {title}\n\n" + markdown_table(header, rows)


def summary_value(summary: dict[str, Any], key: str) -> Any:
    """summary[key]; a dotted key reads nested mappings (client_service.<client_id>) and lists
    by index (ttft_s_p50_by_turn.2: turn 2's)."""
    if key in summary:
        return summary[key]
    value: Any = summary
    for part in key.split("."):
        if isinstance(value, list) and part.isdigit():
            value = value[int(part)] if int(part) < len(value) else None
        elif isinstance(value, dict) and part in value:
            value = value[part]
        else:
            return None
    return value


def format_number(v: Any) -> str:
    """A table cell: '-' for None, four significant digits for floats."""
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def write_run(out_dir: Path, config: Any, summary: dict[str, Any], requests: list[Request], extra_rows=None) -> None:
    """Write the three files of a run, each to a temporary name renamed into place: the
    resolved config.yaml, requests.jsonl (one row per request, in submission order), and
    summary.json last, so a summary.json on disk means the other two are complete; a run that
    speculated (`spec.method`) writes spec_trace.jsonl too (`cbjax.spec.trace`). A folder
    that cannot take them raises OutputError naming it."""
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise OutputError(f"cannot write the output folder {out_dir}: {e.strerror or e}") from e
    cfg = dataclasses.asdict(config) if dataclasses.is_dataclass(config) else config
    atomic_write_text(out_dir / "config.yaml", yaml.safe_dump(cfg, sort_keys=False))
    write_requests(out_dir / "requests.jsonl", requests, extra_rows)
    spec = getattr(config, "spec", None)
    if spec is not None and spec.enabled:
        atomic_write_text(out_dir / TRACE_FILE, "".join(line + "\n" for line in trace_lines(requests)))
    atomic_write_text(out_dir / "summary.json", json.dumps(summary, indent=2, sort_keys=False) + "\n")


def write_requests(path: Path, requests: list[Request], extra_rows=None) -> None:
    """requests.jsonl at `path`: one row per request, in submission order, with `extra_rows(req)`'s
    fields added; written to a temporary name renamed into place."""
    lines = []
    for req in requests:
        row = request_row(req)
        if extra_rows is not None:
            row.update(extra_rows(req))
        lines.append(json.dumps(row) + "\n")
    atomic_write_text(path, "".join(lines))
