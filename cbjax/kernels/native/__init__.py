"""The native CPU kernels: an optional package behind the device seam.

Importing it registers, in `cbjax.kernels.registry`, the `native` attention backend
(`attention.ragged_attention_native`) and the `native` `LayerOps` (`ops.NativeOps`), both the CPU
default where the kernels build (`build.ensure_registered`). Nothing else in cbjax names it:
deleting this package leaves `executor.attention=auto` on `ragged` and `executor.matmul=auto`
on `xla`, with a one-line notice. The sources are `native_*.cc` and `native_common.h`;
docs/cpu_kernels.md describes the kernels and their measurements.
"""

from __future__ import annotations

from typing import Optional

from cbjax.kernels import registry
from cbjax.kernels.native.build import ensure_registered, prune  # noqa: F401  (prune: the package's API)
from cbjax.kernels.native.kernels import (  # noqa: F401  the package's kernel API
    PANEL,
    block_groups_into,
    embed,
    glu_applies,
    greedy,
    layer_matmul,
    layer_matmul_glu,
    layer_matmul_rope,
    matmul_nt,
    rope_applies,
    single_groups,
    to_panels,
    write_kv,
)


def _attention():
    from cbjax.kernels.native.attention import ragged_attention_native

    return ragged_attention_native


def _attention_unavailable(backend: str) -> Optional[str]:
    if backend != "cpu":
        return "it is the CPU kernel; use auto or pallas here"
    error = ensure_registered()
    return None if error is None else registry.Unbuilt(error)


def _ops():
    from cbjax.kernels.native.ops import NativeOps

    return NativeOps()


def _ops_unavailable(backend: str, dtype: str, sharded: bool) -> Optional[str]:
    if backend != "cpu":
        return f"it is a CPU kernel (backend {backend})"
    if dtype != "float32":
        return f"it multiplies float32 only (model.dtype={dtype})"
    if sharded:
        return "it runs on one device (executor.mesh.tensor > 1 or several processes)"
    error = ensure_registered()
    return None if error is None else registry.Unbuilt(error)


registry.register_attention(
    registry.AttentionBackend("native", _attention, grouped=True, cpu_default=True, unavailable=_attention_unavailable)
)
registry.register_ops(registry.OpsBackend("native", _ops, cpu_default=True, unavailable=_ops_unavailable))
