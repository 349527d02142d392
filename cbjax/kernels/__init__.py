"""Device kernels: Pallas implementations with plain-jnp references."""
