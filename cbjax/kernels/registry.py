"""Attention backends by name: `executor.attention=auto|pallas|ragged|reference|triton`.

Every backend implements the `cbjax.kernels.metadata` contract. `auto` is the Pallas kernel
on GPU/TPU and the XLA `ragged` formulation on CPU, where Pallas only runs interpreted.
`triton` is the Pallas kernel forced to its Triton lowering (a GPU). `reference` is the
plain-jnp oracle: every token reads its row's whole page table.
"""

from __future__ import annotations

import functools

import jax

from cbjax.config import ATTENTION_IMPLS
from cbjax.kernels.metadata import AttentionFn


def resolve_attention(impl: str = "auto", backend: str | None = None) -> str:
    """The backend `impl` runs as on `backend` (default: jax's): auto -> pallas or ragged."""
    backend = backend or jax.default_backend()
    if impl not in ATTENTION_IMPLS:
        raise ValueError(f"executor.attention: unknown value {impl!r}; choose one of {', '.join(ATTENTION_IMPLS)}")
    if impl == "triton" and backend != "gpu":
        raise ValueError("executor.attention=triton needs a GPU; use auto, pallas, ragged or reference here")
    if impl == "auto":
        return "ragged" if backend == "cpu" else "pallas"
    return impl


def attention_op(impl: str) -> AttentionFn:
    """The attention function of a resolved backend name (see `resolve_attention`)."""
    if impl == "reference":
        from cbjax.kernels.reference import ragged_attention_reference

        return ragged_attention_reference
    if impl == "ragged":
        from cbjax.kernels.xla_ragged import ragged_attention_xla
        from cbjax.runtime.tiles import PAGES_BLOCK, PAGES_SINGLE

        return functools.partial(ragged_attention_xla, pages_single=PAGES_SINGLE, pages_block=PAGES_BLOCK)
    if impl in ("pallas", "triton"):
        from cbjax.kernels.pallas_ragged import ragged_paged_attention

        on_cpu = jax.default_backend() == "cpu"
        target = "gpu" if impl == "triton" else None
        return functools.partial(ragged_paged_attention, interpret=on_cpu, target=target)
    raise ValueError(f"executor.attention: {impl!r} is not a resolved backend; call resolve_attention first")
