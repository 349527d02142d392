"""One table of a fidelity run (experiments/fidelity_acceptance.sh): its steadiness, the calibration
cells by regime, the continuous / static ratio, the profiles' residual tables and the cluster
checks, each against its target.

    python experiments/fidelity_table.py outputs/fidelity
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, Optional

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from cbjax.report.tables import markdown_table  # noqa: E402

RESIDUAL_LIMIT = 0.05  # a profile's regime: mean signed step-time error
# the separation check (experiments/cluster_ratios.py): split over lone makespan at most this
# when the two replicas run apart (about 0.5), at 1 or more when they share the cores
APART = 0.75


def load(path: Path) -> Optional[Any]:
    return json.loads(path.read_text()) if path.is_file() else None


def rows_of(out: Path) -> list[list[str]]:
    rows: list[list[str]] = []
    steady = load(out / "steadiness.json")
    for setting, r in (steady or {}).items():
        s = r["summary"]
        rows.append(["steadiness", setting, f"spread +{100 * s['spread']:.0f}%",
                     f"{s['near_median']} of {s['runs']} within 5%", "(reported)"])  # fmt: skip
    report = load(out / "calibration" / "calibration.json")
    if report is not None:
        for cell in report["cells"]:
            for key in ("throughput_tok_s", "ttft_s_p50", "e2e_s_p50", "e2e_s_p99"):
                j = cell.get(key)
                if j is None or j.get("within_target") is None:
                    continue
                err = j.get("error_pct")
                rows.append(["cell", f"{cell['name']} ({cell.get('slots', '')} slots)", key,
                             "unmeasured" if err is None else f"{err:+.1f}%", "pass" if j["within_target"] else "FAIL"])  # fmt: skip
        for r in report.get("regimes", []):
            rows.append(["regime mean", f"{r['regime']}", r["figure"], f"{r['mean_signed_error_pct']:+.1f}%",
                         "pass" if r["bias_ok"] else "FAIL"])  # fmt: skip
        for r in report.get("ratios", []):
            err = r.get("error_pct")
            rows.append(["continuous / static", r["workload"], "throughput ratio",
                         "unmeasured" if err is None else f"{err:+.1f}%", r["verdict"]])  # fmt: skip
    for profile in sorted(out.glob("profile_*/profile.json")):
        p = load(profile)
        table = (p.get("residuals") or {}).get("by_regime") or {}
        for regime, row in table.get("regimes", {}).items():
            err = row["mean_signed_error"]
            rows.append(["residual", f"{profile.parent.name} (pinned: {p.get('pinning')})", regime,
                         f"{100 * err:+.1f}%", "pass" if abs(err) <= RESIDUAL_LIMIT else "FAIL"])  # fmt: skip
    decisions = out / "decisions.log"
    if decisions.is_file():
        line = decisions.read_text().strip()
        rows.append(["cluster decisions", "every router and P/D", "same replica", line,
                     "pass" if "passed" in line and "failed" not in line else "FAIL"])  # fmt: skip
    ratios = load(out / "cluster_ratios.json")
    for name, entry in (ratios or {}).get("comparisons", {}).items():
        for key, f in entry["figures"].items():
            rows.append(["cluster ratio", name, key, f"{100 * f['error']:+.1f}% (engine {f['engine_median']:.3f}, "
                         f"sim {f['simulator']:.3f})", "pass" if f["pass"] else "FAIL"])  # fmt: skip
    sep = (ratios or {}).get("separation") or {}
    if sep.get("median") is not None:
        # replicas on hardware of their own finish split in about half the time; SHARED: not here
        rows.append(["cluster separation", "requests split over 2 replicas / all on 1", "makespan",
                     f"{sep['median']:.2f}x (apart: about 0.5)", "apart" if sep["median"] <= APART else "SHARED"])  # fmt: skip
    return rows


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].replace("\n", " "))
    ap.add_argument("out", type=Path, help="the fidelity run's output folder")
    args = ap.parse_args(argv)
    if not args.out.is_dir():
        ap.error(f"out: {args.out}: no such folder")
    rows = rows_of(args.out)
    if not rows:  # an empty table would read as a run with nothing failing
        ap.error(f"out: {args.out}: holds none of a fidelity run's files (experiments/fidelity_acceptance.sh writes them)")
    print(markdown_table(["check", "what", "figure", "error", "verdict"], rows))
    fails = sum(r[-1] == "FAIL" for r in rows)
    print(f"\n{len(rows)} rows, {fails} FAIL")


if __name__ == "__main__":
    main()
