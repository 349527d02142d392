"""cbjax: continuous batching research for LLM inference, in JAX."""

from cbjax import xla_defaults as _xla_defaults

_xla_defaults.apply()

__version__ = "0.1.0"
