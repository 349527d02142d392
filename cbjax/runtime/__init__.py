"""The real engine: jit-compiled prefill and decode steps over a fixed slot array (imports jax)."""
