"""Profiling the engine's step on this machine: `python -m cbjax.profile` writes profile.json for
the simulator's `profiled` cost model (`cbjax.sim.profiled`)."""
