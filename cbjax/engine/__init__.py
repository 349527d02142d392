"""The serving loop: schedule -> execute -> postprocess, its clocks and the offline driver (no jax)."""
