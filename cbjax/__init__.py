"""cbjax: continuous batching research for LLM inference, in JAX."""

__version__ = "0.1.0"
