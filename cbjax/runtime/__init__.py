"""The real engine: plan -> batch -> one jitted step over the fixed slot array (imports jax).

Importing it applies cbjax's XLA:CPU flag defaults (`cbjax.runtime.xla_defaults`) before jax starts its
backend; the scheduler side of cbjax sets no flags.
"""

from cbjax.runtime import xla_defaults as _xla_defaults

_xla_defaults.apply()
