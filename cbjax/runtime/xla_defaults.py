"""XLA:CPU flags cbjax sets before jax starts its backend; no jax import here.

On XLA:CPU in jaxlib 0.10, matmuls go through YNNPACK fusions by default. For the decode
step's few-row matmuls these measured up to ~2x slower than XLA's other CPU kernels on our
2-core machine (benchmarks/peer_transformers.py: whole-run time 3.6 s -> 2.1 s), so cbjax
turns them off with `--xla_cpu_experimental_ynn_fusion_type=` (empty: no YNN fusions).

- Only for jaxlib versions where the flag was checked to exist: XLA aborts on unknown flags.
- Never overrides a value the user put in XLA_FLAGS themselves.
- `CBJAX_XLA_DEFAULTS=0` turns this off.
- It takes effect only if it runs before jax's CPU backend starts (any first jax computation);
  importing `cbjax.runtime` (the engine) does it, so import it before using jax.
"""

from __future__ import annotations

import os
from importlib import metadata

_CPU_FLAGS = {"xla_cpu_experimental_ynn_fusion_type": ""}
_CHECKED_JAXLIB = ("0.10.",)


def apply(environ=os.environ) -> list[str]:
    """Append cbjax's CPU flags to XLA_FLAGS; returns the flags it added."""
    if environ.get("CBJAX_XLA_DEFAULTS", "1") == "0":
        return []
    try:
        version = metadata.version("jaxlib")
    except metadata.PackageNotFoundError:
        return []
    if not version.startswith(_CHECKED_JAXLIB):
        return []
    current = environ.get("XLA_FLAGS", "")
    added = [f"--{name}={value}" for name, value in _CPU_FLAGS.items() if f"--{name}" not in current]
    if added:
        environ["XLA_FLAGS"] = " ".join([current, *added]).strip()
    return added
