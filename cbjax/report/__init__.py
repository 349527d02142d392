"""Metrics, service accounting, run files, tables, plots and paper reproductions (no jax)."""
