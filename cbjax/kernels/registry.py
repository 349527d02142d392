"""Attention backends by name: `executor.attention=auto|native|pallas|ragged|reference|triton`.

Every backend implements the `cbjax.kernels.metadata` contract. `auto` is the Pallas kernel
on GPU/TPU; on CPU, where Pallas only runs interpreted, it is `native` (the XLA `ragged`
formulation with its decode pass in C++, `cbjax.kernels.native`) when the C++ kernel builds
here, else `ragged` itself.
`triton` is the Pallas kernel forced to its Triton lowering (a GPU). `reference` is the
plain-jnp oracle: every token reads its row's whole page table.
"""

from __future__ import annotations

import functools
import sys

import jax

from cbjax.config import ATTENTION_IMPLS, MATMUL_IMPLS
from cbjax.kernels.metadata import AttentionFn


# Backends that run on the XLA ragged formulation's query groups (the packer builds them).
GROUPED = ("ragged", "native")


def resolve_attention(impl: str = "auto", backend: str | None = None) -> str:
    """The backend `impl` runs as on `backend` (default: jax's): auto -> pallas, native or ragged."""
    backend = backend or jax.default_backend()
    if impl not in ATTENTION_IMPLS:
        raise ValueError(f"executor.attention: unknown value {impl!r}; choose one of {', '.join(ATTENTION_IMPLS)}")
    if impl == "triton" and backend != "gpu":
        raise ValueError("executor.attention=triton needs a GPU; use auto, pallas, ragged or reference here")
    if impl == "native":
        if backend != "cpu":
            raise ValueError("executor.attention=native is the CPU kernel; use auto or pallas here")
        error = native_kernel_error()
        if error is not None:
            raise ValueError(f"executor.attention=native: {error}")
    if impl == "auto":
        if backend != "cpu":
            return "pallas"
        error = native_kernel_error()
        if error is not None:
            _warn_once(f"cbjax: executor.attention=auto runs `ragged` on this CPU: {error}")
            return "ragged"
        return "native"
    return impl


def resolve_matmul(impl: str = "auto", dtype: str = "float32", sharded: bool = False, backend: str | None = None) -> str:
    """What `executor.matmul=impl` runs as: auto -> native on CPU for a float32 model on one
    device when the C++ kernels build, else xla. An explicit native outside that raises."""
    backend = backend or jax.default_backend()
    if impl not in MATMUL_IMPLS:
        raise ValueError(f"executor.matmul: unknown value {impl!r}; choose one of {', '.join(MATMUL_IMPLS)}")
    if impl == "xla":
        return impl
    kernel_missing = False
    if backend != "cpu":
        why = f"it is a CPU kernel (backend {backend})"
    elif dtype != "float32":
        why = f"it multiplies float32 only (model.dtype={dtype})"
    elif sharded:
        why = "it runs on one device (executor.mesh.tensor > 1 or several processes)"
    else:
        why = native_kernel_error()
        kernel_missing = why is not None
    if why is None:
        return "native"
    if impl == "native":
        raise ValueError(f"executor.matmul=native: {why}; use auto or xla")
    if kernel_missing:  # auto lost the kernel it would pick: say why
        _warn_once(f"cbjax: executor.matmul=auto runs `xla` on this CPU: {why}")
    return "xla"


def native_kernel_error() -> str | None:
    """None when the native CPU kernel is built and registered, else why it is not."""
    from cbjax.kernels.native import ensure_registered

    return ensure_registered()


@functools.cache
def _warn_once(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def attention_op(impl: str) -> AttentionFn:
    """The attention function of a resolved backend name (see `resolve_attention`)."""
    if impl == "reference":
        from cbjax.kernels.reference import ragged_attention_reference

        return ragged_attention_reference
    if impl in GROUPED:
        from cbjax.kernels.xla_ragged import ragged_attention_xla
        from cbjax.runtime.tiles import PAGES_BLOCK, PAGES_SINGLE

        return functools.partial(
            ragged_attention_xla, pages_single=PAGES_SINGLE, pages_block=PAGES_BLOCK, native=impl == "native"
        )
    if impl in ("pallas", "triton"):
        from cbjax.kernels.pallas_ragged import ragged_paged_attention

        on_cpu = jax.default_backend() == "cpu"
        target = "gpu" if impl == "triton" else None
        return functools.partial(ragged_paged_attention, interpret=on_cpu, target=target)
    raise ValueError(f"executor.attention: {impl!r} is not a resolved backend; call resolve_attention first")
