"""Experiment figures: throughput per arm and the latency CDFs that explain it (matplotlib, Agg)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def plot_comparison(out_dir: Path, summaries: dict[str, dict[str, Any]]) -> Path:
    """Write comparison.png from each arm's summary.json and requests.jsonl under `out_dir`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    arms = list(summaries)
    # horizontal bars, a row per arm, so that dozens of arms (a reproduction's) stay readable
    fig, (ax_tp, ax_cdf) = plt.subplots(1, 2, figsize=(12, max(4.0, 0.3 * len(arms))))
    ax_tp.barh(arms[::-1], [summaries[a]["throughput_tok_s"] for a in arms[::-1]], color="tab:blue")
    ax_tp.set_xlabel("output tokens / s")
    ax_tp.set_title("throughput")
    ax_tp.tick_params(axis="y", labelsize=8 if len(arms) > 8 else 10)
    for arm in arms:
        rows = [json.loads(line) for line in (out_dir / arm / "requests.jsonl").read_text().splitlines()]
        e2e = np.sort([r["e2e_s"] for r in rows if r["e2e_s"] is not None])
        # over every submitted request: an arm that rejected or lost some tops out below 1
        submitted = sum(1 for r in rows if r.get("finish_reason") != "not_arrived")
        if e2e.size:
            ax_cdf.plot(e2e, np.arange(1, e2e.size + 1) / submitted, label=arm)
    ax_cdf.set_xlabel("end-to-end latency (s)")
    ax_cdf.set_ylabel("fraction of requests")
    ax_cdf.set_title("latency CDF")
    ax_cdf.legend(fontsize=7 if len(arms) > 8 else None, ncol=1 + len(arms) // 20)
    fig.tight_layout()
    path = out_dir / "comparison.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
