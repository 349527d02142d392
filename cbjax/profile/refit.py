"""`python -m cbjax.profile.refit PROFILE.json`: fit a profile again from the steps it recorded,
without the engine.

A profile keeps every grid step, swap, served iteration (with its round and whether it was held
out), loop gap and the wake timings it measured; refitting them with other fit options (or after
a change to the fit) takes a second where profiling again takes minutes and lands on another
spell of a shared machine. The refitted coefficients and residual table replace the file's
(`--out`: written elsewhere). Pure numpy: no jax import.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, Optional

from cbjax.layout.shapes import ShapePlan, plan_shapes
from cbjax.profile.measure import fit_profile
from cbjax.profile.residuals import format_table
from cbjax.profile.served_fit import SERVED_WEIGHTINGS
from cbjax.report.files import atomic_write_text

# what a profile must hold to be refitted (profiles made before `gaps` was recorded lack it)
RECORDED = ("steps", "swaps", "served", "gaps", "wake", "coefficients")


def profile_shapes(profile: dict[str, Any]) -> Optional[ShapePlan]:
    """The engine's shape plan a profile was made for, from what it records (None: it lacks them)."""
    made = profile.get("made_for", {})
    try:
        return plan_shapes(
            made["scheduler.max_num_seqs"], made["model.max_model_len"], made["cache.page_size"],
            profile["max_num_batched_tokens"], profile.get("token_buckets"),
        )  # fmt: skip
    except KeyError:
        return None


def refit(profile: dict[str, Any], fit_cold: bool, served_terms: bool, served_weighting: str) -> dict[str, Any]:
    """`profile` with its coefficients and residuals fitted again (`fit_profile`) on its recorded
    steps, and the options it was fitted with; a profile without them is a ValueError naming the key."""
    missing = [k for k in RECORDED if k not in profile]
    if missing:
        raise ValueError(f"the profile lacks {', '.join(missing)}: profile again with `python -m cbjax.profile`")
    # the cold terms belong to the CPU term set: a profile made without it (an accelerator's,
    # or cpu_terms=false) fits them 0 whatever fit_cold says, as `run_profile` does
    fit_cold = fit_cold and bool(profile.get("cpu_terms", True))
    bucket_s = {int(b): float(v) for b, v in profile["coefficients"]["bucket_s"].items()}
    gaps = [(int(n), float(g)) for n, g in profile["gaps"]]
    coefficients, residuals = fit_profile(
        profile["steps"], profile["swaps"], bucket_s, profile["served"], gaps, profile["wake"],
        fit_cold=fit_cold, served_terms=served_terms, served_weighting=served_weighting,
        copies=profile.get("served_copies"), served_wake=profile.get("served_wake"), shapes=profile_shapes(profile),
        native=profile.get("attention") == "native", fit_held=profile.get("cpu_terms", True),
    )  # fmt: skip
    return {**profile, "coefficients": coefficients, "residuals": residuals, "fit_cold": fit_cold,
            "served_terms": served_terms, "served_weighting": served_weighting}  # fmt: skip


def main(argv: Optional[list[str]] = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("profile", help="profile.json from `python -m cbjax.profile`")
    ap.add_argument("--out", default=None, help="where to write the refitted profile (default: in place)")
    ap.add_argument("--served-weighting", default="mean_relative", choices=SERVED_WEIGHTINGS)
    ap.add_argument("--no-served-terms", action="store_true", help="keep the grid's per-row, per-page and per-block-step terms")
    ap.add_argument("--no-cold", action="store_true", help="no cold terms (they stay 0)")
    args = ap.parse_args(argv)
    path = Path(args.profile)
    try:
        profile = json.loads(path.read_text())
        out = refit(profile, not args.no_cold, not args.no_served_terms, args.served_weighting)
    except (OSError, json.JSONDecodeError, ValueError, KeyError, TypeError) as err:
        sys.exit(f"cbjax.profile.refit: error: {path}: {type(err).__name__}: {err}")
    target = Path(args.out) if args.out else path
    try:  # atomically: an interrupted refit in place leaves the profile as it was
        atomic_write_text(target, json.dumps(out, indent=2) + "\n")
    except OSError as err:  # OutputError: one line naming the file
        sys.exit(f"cbjax.profile.refit: error: {err}")
    table = out["residuals"]["by_regime"]
    print(f"served step time by regime and bucket, on the {table['steps']} served steps (+: over-predicted):")
    print("\n".join(format_table(table)))
    for line in table["sparse"] + table["failures"]:
        print(("FAIL: " if line in table["failures"] else "under-sampled: ") + line)
    print(f"wrote {target}")


if __name__ == "__main__":
    main()
