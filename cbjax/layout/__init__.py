"""Pure-numpy layout of a step: token buckets and slot shapes (`shapes`), attention query groups
(`tiles`). Both the engine and the simulator import it; it imports neither jax nor XLA flags."""
