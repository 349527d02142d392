#!/usr/bin/env bash
# The simulator's fidelity check, in one go, on a quiet machine (run from a fresh clone's root),
# every engine pinned to one core (`cores=1`; docs/CALIBRATION.md says why):
#   1. steadiness: experiments/steadiness.py, unpinned and pinned side by side (is one core steady?);
#   2. profiles of SmolLM-135M's shape (random weights, 8 slots, 256-token steps) and of the tiny
#      model at 16 and 32 slots, each printing its held-out step-time residual table by regime
#      (a regime beyond 5% mean signed error prints a FAIL line);
#   3. the calibration of the tiny model's acceptance cells at both slot counts, 5 engine runs a
#      cell at the profile's machine speed, the engine pinned as its profile;
#   4. clusters: the decision identity (tests/test_cluster_decisions.py), and the interleaved
#      A/B ratios of 2-replica engine runs, a core per replica (experiments/cluster_ratios.py).
# It prints one table at the end. Logs and profiles go to $OUT (default outputs/fidelity); the
# calibration's tables to $DOC (default docs/CALIBRATION.md, whose hand-kept guide is kept).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-outputs/fidelity}
DOC=${DOC:-docs/CALIBRATION.md}
mkdir -p "$OUT"
start=$(date +%s)
. experiments/acceptance_lib.sh  # steady, short
python experiments/steadiness.py scheduler.max_num_seqs=32 --runs 6 --side-by-side \
  --out "$OUT/steadiness.json" 2>/dev/null | tee "$OUT/steadiness.log"
# SmolLM's shape first: its profile takes minutes, and the tiny profiles are best taken just
# before their calibration, at the machine speed it will find (`cbjax.profile.anchor`)
for attempt in 1 2; do  # a profile whose machine changed speed while it ran is taken again
  python -m cbjax.profile cores=1 model=smollm_135m scheduler.max_num_seqs=8 scheduler.max_num_batched_tokens=256 \
    progress=false hydra.run.dir="$OUT/profile_smollm_135m" 2>&1 | grep -v "\[INFO\]" | tee "$OUT/profile_smollm_135m.log"
  if steady "$OUT/profile_smollm_135m/profile.json"; then break; fi
  echo "SmolLM profile, attempt $attempt: the machine changed speed while it ran"
done
for slots in 16 32; do  # each slot count calibrated right after its profile
  for calibration in 1 2; do  # a calibration whose machine left the profile's speed: a new profile, once
    for attempt in 1 2 3; do  # a profile whose machine changed speed while it ran is taken again
      python -m cbjax.profile cores=1 scheduler.max_num_seqs=$slots progress=false \
        hydra.run.dir="$OUT/profile_tiny_$slots" 2>&1 | grep -v "\[INFO\]" | tee "$OUT/profile_tiny_$slots.log"
      if steady "$OUT/profile_tiny_$slots/profile.json"; then break; fi
      echo "profile at $slots slots, attempt $attempt: the machine changed speed while it ran"
    done
    # 5 runs per cell at the profile's speed, the engine pinned as the profile was
    python experiments/calibrate.py --repeats 5 --profile "$OUT/profile_tiny_$slots/profile.json" \
      --out-dir "$OUT/calibration_$slots" --doc "$OUT/calibration_$slots/CALIBRATION.md" 2>&1 \
      | tee "$OUT/calibration_${slots}_$calibration.log"
    if ! short "$OUT/calibration_$slots/calibration.json"; then break; fi
    echo "calibration at $slots slots, $calibration: a cell ended short of runs at the profile's speed"
  done
done
python experiments/calibrate.py --profile "$OUT/profile_tiny_16/profile.json" "$OUT/profile_tiny_32/profile.json" \
  --reports "$OUT/calibration_16/calibration.json" "$OUT/calibration_32/calibration.json" \
  --residual-profiles "$OUT/profile_smollm_135m/profile.json" \
  --out-dir "$OUT/calibration" --doc "$DOC" 2>&1 | tee "$OUT/calibration.log"
python -m pytest -q -p no:cacheprovider tests/test_cluster_decisions.py 2>&1 | tail -1 | tee "$OUT/decisions.log"
python experiments/cluster_ratios.py --profile "$OUT/profile_tiny_16/profile.json" --pairs 5 \
  --out "$OUT/cluster_ratios.json" 2>/dev/null | tee "$OUT/cluster_ratios.log"
echo "all took $(( $(date +%s) - start )) s"
echo
echo "== fidelity, in one table =="
python experiments/fidelity_table.py "$OUT"
