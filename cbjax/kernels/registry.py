"""Attention backends and layer-op implementations by name: the device seam's registry.

`executor.attention=auto|native|pallas|ragged|reference|triton` names an attention function
(the `cbjax.kernels.metadata` contract); `executor.matmul=auto|native|xla` names the `LayerOps`
(`cbjax.model.ops`) the step runs its fused ops with. Core registers `reference`, `ragged`,
`pallas`, `triton` and `xla`; an optional kernel package registers more when it is imported
(`cbjax.kernels.native`: the CPU kernels, `native` for both). `auto` is the Pallas kernel on
GPU/TPU; on CPU it is the registered CPU default (`native`) where its kernels build here, else
`ragged` / `xla`, with a one-line notice saying why. The names the config accepts are read from
here (`attention_names`, `matmul_names`); this module imports jax only where it resolves a name,
so a simulated run checks its config without loading jax.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import sys
from typing import TYPE_CHECKING, Callable, Optional

if TYPE_CHECKING:
    from cbjax.kernels.metadata import AttentionFn

# Optional packages that register backends when imported, with the names they register them
# under (`executor.attention`, `executor.matmul`): the config accepts those names before the
# package is imported, and where it is missing they are refused when resolved, saying why.
PLUGINS = {"cbjax.kernels.native": {"attention": "native", "matmul": "native"}}


@dataclasses.dataclass(frozen=True)
class AttentionBackend:
    """An attention implementation. `make()` returns the function, called as
    `attn(q, k_pages, v_pages, md, layer=layer_idx)` on the whole stacked cache (every backend
    reads layer `layer_idx`'s pages in place). `unavailable(backend)`: None where it runs on this
    jax backend, else the reason."""

    name: str
    make: Callable[[], AttentionFn]
    grouped: bool = False  # reads the packer's query groups (`cbjax.kernels.xla_ragged.RaggedWork`)
    cpu_default: bool = False  # what `auto` picks on CPU where it is available
    unavailable: Callable[[str], Optional[str]] = lambda backend: None


@dataclasses.dataclass(frozen=True)
class OpsBackend:
    """A `cbjax.model.ops.LayerOps` implementation. `unavailable(backend, dtype, sharded)`:
    None where it runs for this model and device layout, else the reason."""

    name: str
    make: Callable[[], object]
    cpu_default: bool = False
    unavailable: Callable[[str, str, bool], Optional[str]] = lambda backend, dtype, sharded: None


_ATTENTION: dict[str, AttentionBackend] = {}
_OPS: dict[str, OpsBackend] = {}
_missing: dict[str, str] = {}  # plugin -> why it did not load


def register_attention(backend: AttentionBackend) -> None:
    _ATTENTION[backend.name] = backend


def register_ops(backend: OpsBackend) -> None:
    _OPS[backend.name] = backend


def attention_names() -> tuple[str, ...]:
    """Every `executor.attention` value: auto, the registered backends, the plugins' ones."""
    return _names(_ATTENTION, "attention")


def matmul_names() -> tuple[str, ...]:
    """Every `executor.matmul` value: auto, the registered implementations, the plugins' ones."""
    return _names(_OPS, "matmul")


def _names(registered: dict, key: str) -> tuple[str, ...]:
    names = ["auto", *registered]
    names += [declared[key] for declared in PLUGINS.values() if key in declared and declared[key] not in names]
    return tuple(names)


@functools.cache
def load_plugins() -> None:
    """Import the optional kernel packages once; each registers its backends."""
    for name in PLUGINS:
        try:
            importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name is None or not name.startswith(exc.name) and not exc.name.startswith(name):
                raise  # a dependency of the package is missing: that is a bug to see
            _missing[name] = f"the optional kernel package {name} is not installed"


@functools.cache
def _notice(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _missing_notice() -> str:
    """One line for both auto choices when a kernel package is absent."""
    return (f"cbjax: {'; '.join(_missing.values())}: executor.attention=auto runs `ragged` and "
            f"executor.matmul=auto runs `xla` on this CPU")


def _not_registered(key: str, impl: str) -> str:
    why = "; ".join(_missing.values()) or "no package registered it"
    return f"executor.{key}={impl}: not available ({why})"


def resolve_attention(impl: str = "auto", backend: str | None = None, *, page_size: int | None = None,
                      head_dim: int | None = None) -> str:
    """The registered backend `impl` runs as on `backend` (default: jax's): auto -> pallas on
    GPU/TPU, the CPU default (native) or ragged on CPU. Given the cache's `page_size` and the
    model's `head_dim`, a GPU shape Triton cannot lower turns auto into ragged and refuses an
    explicit pallas or triton, naming the field (else the step fails when it first compiles)."""
    backend = backend or _default_backend()
    if impl not in attention_names():
        raise ValueError(f"executor.attention: unknown value {impl!r}; choose one of {', '.join(attention_names())}")
    load_plugins()
    if impl == "auto":
        if backend != "cpu":
            why = _triton_misfit(backend, page_size, head_dim)
            if why is not None:
                _notice(f"cbjax: executor.attention=auto runs `ragged` on this GPU: {why}")
                return "ragged"
            return "pallas"
        for entry in _ATTENTION.values():
            if entry.cpu_default:
                why = entry.unavailable(backend)
                if why is None:
                    return entry.name
                _notice(f"cbjax: executor.attention=auto runs `ragged` on this CPU: {why}")
                return "ragged"
        _notice(_missing_notice())
        return "ragged"
    entry = _ATTENTION.get(impl)
    if entry is None:
        raise ValueError(_not_registered("attention", impl))
    why = entry.unavailable(backend)
    if why is None and impl in ("pallas", "triton"):
        why = _triton_misfit(backend, page_size, head_dim)
    if why is not None:
        raise ValueError(f"executor.attention={impl}: {why}")
    return impl


def _triton_misfit(backend: str, page_size: int | None, head_dim: int | None) -> Optional[str]:
    """Why the Pallas kernel cannot lower through Triton on `backend` for these shapes, or None
    (`cbjax.kernels.pallas_ragged`: on a GPU, page_size and head_dim powers of two >= 16)."""
    if backend not in ("gpu", "cuda", "rocm"):
        return None
    bad = [f"{field} {n}" for field, n in (("cache.page_size", page_size), ("model.head_dim", head_dim))
           if n is not None and not (n >= 16 and n & (n - 1) == 0)]  # fmt: skip
    if not bad:
        return None
    return f"Triton needs page_size and head_dim powers of two >= 16, got {', '.join(bad)}; use ragged or reference"


def resolve_matmul(impl: str = "auto", dtype: str = "float32", sharded: bool = False, backend: str | None = None) -> str:
    """The registered `LayerOps` `executor.matmul=impl` runs as: auto -> the CPU default
    (native: a float32 model on one CPU device, where its kernels build), else xla. An
    explicit name that does not apply raises, saying why."""
    backend = backend or _default_backend()
    if impl not in matmul_names():
        raise ValueError(f"executor.matmul: unknown value {impl!r}; choose one of {', '.join(matmul_names())}")
    if impl == "xla":
        return impl
    load_plugins()
    if impl == "auto":
        defaults = [e for e in _OPS.values() if e.cpu_default]
        if not defaults:
            if backend == "cpu" and _missing:
                _notice(_missing_notice())
            return "xla"
        for entry in defaults:
            why = entry.unavailable(backend, dtype, sharded)
            if why is None:
                return entry.name
            if getattr(why, "kernel_missing", False):  # auto lost the kernels it would pick: say why
                _notice(f"cbjax: executor.matmul=auto runs `xla` on this CPU: {why}")
        return "xla"
    entry = _OPS.get(impl)
    if entry is None:
        raise ValueError(_not_registered("matmul", impl))
    why = entry.unavailable(backend, dtype, sharded)
    if why is not None:
        raise ValueError(f"executor.matmul={impl}: {why}; use auto or xla")
    return impl


class Unbuilt(str):
    """A reason that is the kernels' own failure to build (auto says it), not a misfit of
    dtype, device count or backend (auto stays quiet)."""

    kernel_missing = True


class _Grouped:
    """`name in GROUPED`: whether the backend reads the packer's query groups."""

    def __contains__(self, name: object) -> bool:
        load_plugins()
        entry = _ATTENTION.get(name) if isinstance(name, str) else None
        return entry is not None and entry.grouped


GROUPED = _Grouped()


def attention_op(impl: str) -> AttentionFn:
    """The attention function of a resolved backend name (see `resolve_attention`)."""
    load_plugins()
    entry = _ATTENTION.get(impl)
    if entry is None:
        raise ValueError(f"executor.attention: {impl!r} is not a registered backend; call resolve_attention first")
    return entry.make()


def layer_ops(impl: str):
    """The `LayerOps` of a resolved `executor.matmul` name (see `resolve_matmul`)."""
    load_plugins()
    entry = _OPS.get(impl)
    if entry is None:
        raise ValueError(f"executor.matmul: {impl!r} is not a registered implementation; call resolve_matmul first")
    return entry.make()


def _default_backend() -> str:
    import jax

    return jax.default_backend()


def _reference() -> AttentionFn:
    from cbjax.kernels.reference import ragged_attention_reference

    return ragged_attention_reference


def _ragged() -> AttentionFn:
    from cbjax.kernels.xla_ragged import ragged_attention_xla
    from cbjax.layout.tiles import PAGES_BLOCK, PAGES_SINGLE

    return functools.partial(ragged_attention_xla, pages_single=PAGES_SINGLE, pages_block=PAGES_BLOCK)


def _pallas(target: Optional[str]) -> Callable[[], AttentionFn]:
    def make() -> AttentionFn:
        from cbjax.kernels.pallas_ragged import ragged_paged_attention

        return functools.partial(ragged_paged_attention, interpret=_default_backend() == "cpu", target=target)

    return make


def _xla_ops():
    from cbjax.model.ops import XlaOps

    return XlaOps()


register_attention(AttentionBackend("reference", _reference))
register_attention(AttentionBackend("ragged", _ragged, grouped=True))
register_attention(AttentionBackend("pallas", _pallas(None)))
register_attention(AttentionBackend(
    "triton", _pallas("gpu"),
    unavailable=lambda b: None if b == "gpu" else "it needs a GPU; use auto, pallas, ragged or reference here",
))  # fmt: skip
register_ops(OpsBackend("xla", _xla_ops))
