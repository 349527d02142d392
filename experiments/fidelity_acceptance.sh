#!/usr/bin/env bash
# The simulator's fidelity check, in one go, on a quiet machine (run from a fresh clone's root):
#   - profiles of the tiny model at 16 and 32 slots and of SmolLM-135M's shape (random weights,
#     8 slots, 256-token steps), each printing its held-out step-time residual table by regime
#     (a regime beyond 5% mean signed error prints a FAIL line);
#   - the calibration of the tiny model's acceptance cells at both slot counts, 5 engine runs
#     each at the profile's machine speed, writing docs/CALIBRATION.md's tables with the three
#     profiles' residual tables. A calibration that ends with a cell short of them (the machine
#     left the profile's speed and stayed away) is run again after a new profile, once.
# Logs and profiles go to $OUT (default outputs/fidelity); the document to $DOC (default
# docs/CALIBRATION.md, whose hand-kept guide is kept).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-outputs/fidelity}
DOC=${DOC:-docs/CALIBRATION.md}
mkdir -p "$OUT"
start=$(date +%s)
# SmolLM's shape first: its profile takes minutes, and the tiny profiles are best taken just
# before their calibration, at the machine speed it will find (`cbjax.profile.anchor`)
. experiments/acceptance_lib.sh  # steady, short
for attempt in 1 2; do  # a profile whose machine changed speed while it ran is taken again
  python -m cbjax.profile model=smollm_135m scheduler.max_num_seqs=8 scheduler.max_num_batched_tokens=256 progress=false \
    hydra.run.dir="$OUT/profile_smollm_135m" 2>&1 | grep -v "\[INFO\]" | tee "$OUT/profile_smollm_135m.log"
  if steady "$OUT/profile_smollm_135m/profile.json"; then break; fi
  echo "SmolLM profile, attempt $attempt: the machine changed speed while it ran"
done
for slots in 16 32; do  # each slot count calibrated right after its profile
  for calibration in 1 2; do  # a calibration whose machine left the profile's speed: a new profile, once
    for attempt in 1 2 3; do  # a profile whose machine changed speed while it ran is taken again
      python -m cbjax.profile scheduler.max_num_seqs=$slots progress=false \
        hydra.run.dir="$OUT/profile_tiny_$slots" 2>&1 | grep -v "\[INFO\]" | tee "$OUT/profile_tiny_$slots.log"
      if steady "$OUT/profile_tiny_$slots/profile.json"; then break; fi
      echo "profile at $slots slots, attempt $attempt: the machine changed speed while it ran"
    done
    # 5 runs per cell at the profile's speed: more need the machine to hold one speed for
    # longer than a shared VM often does (docs/CALIBRATION.md)
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
echo "all took $(( $(date +%s) - start )) s"
grep -h "^FAIL\|^served step time\|^[a-z]*: [0-9]* steps" "$OUT"/profile_*.log || true
