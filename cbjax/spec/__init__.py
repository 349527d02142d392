"""Speculative decoding on the host (no jax): the n-gram proposer, the speculation-length policies
and the acceptance trace. The scheduler's side is `cbjax.scheduler.drafts`, the simulator's
acceptance models `cbjax.sim.acceptance`."""
