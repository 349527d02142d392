# Shell helpers the acceptance scripts share (sourced, not run).

steady() {  # whether a profile's anchor held one machine speed (cbjax.profile.anchor.steady)
  python -c "import json, sys; from cbjax.profile.anchor import steady
sys.exit(0 if steady(json.load(open(sys.argv[1])).get('anchor')) else 1)" "$1"
}

short() {  # whether a calibration's cell ended short of its runs at the profile's speed (calibrate.py's
  # or calibrate_cluster.py's results JSON; a cluster's lone-replica control cells do not count)
  python -c "import json, sys
r = json.load(open(sys.argv[1]))
sys.exit(0 if any(c['runs_judged'] < r['repeats'] for c in r['cells'] if not c.get('control')) else 1)" "$1"
}
