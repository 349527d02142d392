"""One plot per reproduced figure: ours against the paper, the arms behind each ordering, and
per-client service over time where the figure is about client service."""

from __future__ import annotations

import textwrap
from pathlib import Path
from typing import Any

# A row's setting names its knob after this marker; plots print "(calibrated)" instead.
KNOB_MARKER = ", with the modelling-difference knob"
LABEL_CHARS = 44  # a value row's label wraps at this width, beside a panel of LABEL_WIDTH_IN
LABEL_WIDTH_IN = 3.0
TITLE_CHARS = 56  # a panel's title wraps to fit its 4.6-inch width


def short_label(setting: str) -> str:
    """The setting without its knob's details, which would overflow a plot's labels."""
    head, knob, _ = setting.partition(KNOB_MARKER)
    return head + (" (calibrated)" if knob else "")


def _wrap(text: str, width: int) -> str:
    return "\n".join(textwrap.wrap(text, width)) or text


def plot_figure(path: Path, title: str, rows: list[dict[str, Any]], series: dict[str, dict[str, list]]) -> Path:
    """Write `path` (PNG) for the rows of one figure (records from experiments/reproduce.py)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    values = [r for r in rows if r["kind"] in ("value", "exact")]
    ranked = [r for r in rows if r["kind"] in ("ordering", "argmin_in", "best_of")]
    show_series = bool(series) and any(r["metric"].startswith("client_service.") for r in rows)
    panels = (1 if values else 0) + len(ranked) + (len(series) if show_series else 0)
    # the value rows' labels get their own width, so long settings do not squeeze the panels
    width = 4.6 * panels + (LABEL_WIDTH_IN if values else 0.0)
    height = max(3.8, 1.8 + 0.55 * len(values))
    fig, axes = plt.subplots(1, panels, figsize=(width, height), squeeze=False, layout="constrained")
    axes = list(axes[0])
    if values:
        _agreement(axes.pop(0), values)
    for row in ranked:
        _arms(axes.pop(0), row)
    if show_series:
        for arm, clients in series.items():
            _series(axes.pop(0), arm, clients)
    fig.suptitle(title)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _agreement(ax, rows: list[dict[str, Any]]) -> None:
    """Ours / paper per setting, with the tolerance band around 1."""
    labels = [_wrap(short_label(r["setting"]) or r["metric"], LABEL_CHARS) for r in rows]
    ratios = [r["ours"] / r["paper"] if r["ours"] is not None and r["paper"] else 0.0 for r in rows]
    colors = ["tab:green" if r["verdict"] == "pass" else "tab:red" for r in rows]
    y = range(len(rows))
    ax.barh(list(y), ratios, color=colors)
    for i, r in enumerate(rows):
        tol = r["tolerance"] or 0.0
        ax.fill_betweenx([i - 0.45, i + 0.45], 1 - tol, 1 + tol, color="grey", alpha=0.25, lw=0)
        ours = "-" if r["ours"] is None else f"{r['ours']:.4g}"
        ax.text(0.02, i, f"ours {ours} / paper {r['paper']:.4g}", va="center", fontsize=7, transform=ax.get_yaxis_transform())
    ax.axvline(1.0, color="black", lw=0.8)
    ax.set_yticks(list(y), labels, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("ours / paper (band: tolerance)")


def _arms(ax, row: dict[str, Any]) -> None:
    """The metric per arm, in the paper's order (ordering) or with the paper's set marked."""
    arms = list(row["arm_values"])
    vals = [row["arm_values"][a] or 0.0 for a in arms]
    colors = ["tab:blue"] * len(arms)
    if row["kind"] == "argmin_in":
        # the paper's best arms by name (`paper_set`); `paper` is free text for the table
        # ("16-128") and names no arm
        best = set(row.get("paper_set") or ())
        colors = ["tab:green" if a in best else "tab:blue" for a in arms]
    ax.bar(arms, vals, color=colors)
    ax.set_title(_wrap(f"{short_label(row['setting'])}: {row['verdict']}", TITLE_CHARS), fontsize=9)
    ax.set_ylabel(row["metric"], fontsize=8)
    ax.tick_params(axis="x", labelrotation=30, labelsize=7)


def _series(ax, arm: str, clients: dict[str, list[list[float]]]) -> None:
    """Per-client service rate over time for one arm (client_service.csv)."""
    for client, points in clients.items():
        ax.plot([p[0] for p in points], [p[1] for p in points], label=client)
    ax.set_title(f"{arm}: service over time", fontsize=9)
    ax.set_xlabel("time (s)")
    ax.set_ylabel("weighted tokens / s")
    ax.legend(fontsize=7)
