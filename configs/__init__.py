"""Hydra configs (the repository's top-level configs/), shipped as cbjax.configs for `pkg://cbjax.configs`."""
