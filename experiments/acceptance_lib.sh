# Shell helpers of experiments/fidelity_acceptance.sh (sourced, not run).

steady() {  # whether a profile's anchor held one machine speed (cbjax.profile.anchor.steady)
  python -c "import json, sys; from cbjax.profile.anchor import steady
sys.exit(0 if steady(json.load(open(sys.argv[1])).get('anchor')) else 1)" "$1"
}

short() {  # whether a calibration's cell ended short of its runs at the profile's speed (calibrate.py's
  # results JSON)
  python -c "import json, sys
r = json.load(open(sys.argv[1]))
sys.exit(0 if any(c['runs_judged'] < r['repeats'] for c in r['cells']) else 1)" "$1"
}
