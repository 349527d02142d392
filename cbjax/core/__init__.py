"""The core contract: requests, plans and their results, the executor protocol, run results, the stop flag (no jax)."""
