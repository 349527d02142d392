# Shell helpers the acceptance scripts share (sourced, not run).

steady() {  # whether a profile's anchor held one machine speed (cbjax.profile.anchor.steady)
  python -c "import json, sys; from cbjax.profile.anchor import steady
sys.exit(0 if steady(json.load(open(sys.argv[1])).get('anchor')) else 1)" "$1"
}
