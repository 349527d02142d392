"""Building the native CPU kernels and registering them with XLA (no kernel math here).

The sources (`native_*.cc`, `native_common.h`) are compiled with the system GCC C++ compiler (`CXX`,
else `g++`, else `c++`) at first use, with one progress line on stderr, and kept in
`~/.cache/cbjax/native` (`CBJAX_NATIVE_DIR` overrides), keyed by the sources, the compiler, the
flags, jaxlib's version and the CPU (`-march=native`); later processes load that build. A build
prunes builds nobody loaded for `STALE_S` and half-written ones a crashed build left. Without a
compiler, or if the build fails, `ensure_registered()` returns the reason and the registry runs
the XLA implementations instead.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from importlib import metadata
from pathlib import Path
from typing import Optional

import jax

COMMON_FLAGS = ("-O3", "-march=native", "-fno-math-errno", "-std=c++17", "-fPIC", "-w")
# Each source with its own flags, and the custom call targets it defines (name, symbol).
# Attention: -fassociative-math lets the compiler vectorize the dot products (their sums
# reassociate); NaN and infinity handling stay IEEE (no -ffinite-math-only).
# Matmul: no reassociation, so each output sums over k in order whatever the row count (a
# row's result is the same alone or in a batch).
SOURCES = {
    "native_decode.cc": (("-fassociative-math", "-fno-signed-zeros", "-fno-trapping-math"),
                         (("cbjax_single_groups", "CbjaxSingleGroups"), ("cbjax_block_groups_into", "CbjaxBlockGroupsInto"),
                          ("cbjax_write_kv", "CbjaxWriteKV"))),
    "native_gemm.cc": (
        (),
        (("cbjax_layer_matmul", "CbjaxLayerMatmul"), ("cbjax_layer_matmul_glu", "CbjaxLayerMatmulGlu"),
         ("cbjax_layer_matmul_rope", "CbjaxLayerMatmulRope"),
         ("cbjax_matmul_nt", "CbjaxMatmulNT")),
    ),
    "native_tokens.cc": ((), (("cbjax_embed", "CbjaxEmbed"), ("cbjax_greedy", "CbjaxGreedy"))),
}  # fmt: skip
HERE = Path(__file__).parent
HEADERS = ("native_common.h",)  # included by the sources

STALE_S = 30 * 24 * 3600.0  # a build nobody loaded for this long is pruned by the next build
_lock = threading.Lock()
_state: dict[str, object] = {}


def cache_dir() -> Path:
    return Path(os.environ.get("CBJAX_NATIVE_DIR") or Path.home() / ".cache" / "cbjax" / "native")


def _is_gcc(cxx: str) -> bool:
    """Whether `cxx` is GCC: the sources use GCC's vector extensions (`__builtin_shuffle` with
    run-time masks), which clang does not build."""
    try:
        out = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return False
    return "clang" not in out.lower()


def _compiler() -> Optional[str]:
    """The first GCC C++ compiler of `CXX`, `g++`, `c++` on PATH; None when there is none."""
    for name in (os.environ.get("CXX"), "g++", "c++"):
        path = shutil.which(name) if name else None
        if path and _is_gcc(path):
            return path
    return None


def _cpu_features() -> str:
    """What -march=native compiles for: the CPU's model and flags (a home directory shared by
    machines with other CPUs gets a library per CPU)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.machine() + platform.processor()
    return "\n".join(sorted({ln for ln in lines if ln.startswith(("model name", "flags"))}))


def _library_path(cxx: str) -> Path:
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True).stdout
    h = hashlib.sha256()
    parts = [version.encode(), " ".join(COMMON_FLAGS).encode(), metadata.version("jaxlib").encode(),
             _cpu_features().encode()]  # fmt: skip
    for name, (flags, targets) in SOURCES.items():
        parts += [name.encode(), (HERE / name).read_bytes(), " ".join(flags).encode(), repr(targets).encode()]
    parts += [(HERE / name).read_bytes() for name in HEADERS]
    for part in parts:
        h.update(part)
        h.update(b"\0")
    return cache_dir() / f"cbjax_native_{h.hexdigest()[:16]}.so"


def _build(cxx: str, out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    print("cbjax: building native CPU kernels (first use, ~30 s)...", file=sys.stderr, flush=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as objects:
        cmds = [[cxx, *COMMON_FLAGS, *flags, f"-I{jax.ffi.include_dir()}", "-c", str(HERE / name),
                 "-o", str(Path(objects) / f"{name}.o")] for name, (flags, _) in SOURCES.items()]  # fmt: skip
        link = [cxx, "-shared", *(c[-1] for c in cmds), "-o", tmp]
        # the sources compile side by side, then link
        procs = [(cmd, subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)) for cmd in cmds]
        results = [(cmd, proc.communicate()[0], proc.returncode) for cmd, proc in procs]
        link_proc = subprocess.run(link, capture_output=True, text=True) if all(rc == 0 for *_, rc in results) else None
        if link_proc is not None:
            results.append((link, link_proc.stderr or link_proc.stdout, link_proc.returncode))
        for cmd, output, rc in results:
            if rc != 0:
                os.unlink(tmp)
                raise RuntimeError(f"{' '.join(cmd)} failed: {output.strip()[-1500:]}")
    os.replace(tmp, out)  # atomic: a concurrent process sees the whole library or none
    prune(out.parent, keep=out)


def _touch(path: Path) -> None:
    """Mark a build as loaded now (a read-only cache directory just keeps its old time)."""
    try:
        os.utime(path)
    except OSError:
        pass


def prune(directory: Path, keep: Path, now: Optional[float] = None) -> list[Path]:
    """Delete the builds in `directory` (but `keep`) last loaded over STALE_S ago, and half-written
    builds (`tmp*.so`) over a day old; returns what it deleted. A library still loaded by a running
    process stays usable: unlinking a file does not unmap it."""
    now = time.time() if now is None else now
    gone = []
    for path in [*directory.glob("cbjax_native_*.so"), *directory.glob("tmp*.so")]:
        limit = STALE_S if path.name.startswith("cbjax_native_") else 24 * 3600.0
        try:
            if path != keep and now - path.stat().st_mtime > limit:
                path.unlink()
                gone.append(path)
        except OSError:  # another process pruned or replaced it first
            pass
    return gone


def ensure_registered() -> Optional[str]:
    """Build (or find) and register the kernel once per process. None when it is ready, else
    the reason it is not (no compiler, a failed build)."""
    with _lock:
        if "error" in _state:
            return _state["error"]  # type: ignore[return-value]
        error = None
        try:
            cxx = _compiler()
            if cxx is None:
                raise RuntimeError("no GCC C++ compiler found (set CXX, or install g++; clang cannot build these sources)")
            path = _library_path(cxx)
            if not path.exists():
                _build(cxx, path)
            else:
                _touch(path)
            lib = ctypes.cdll.LoadLibrary(str(path))
            for _, targets in SOURCES.values():
                for target, symbol in targets:
                    jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(lib, symbol)), platform="cpu")
            lib.cbjax_matmul_tile_columns.restype = ctypes.c_int64
            _state["tile_columns"] = int(lib.cbjax_matmul_tile_columns())  # for rope_applies
            _state["lib"] = lib  # keep the library loaded
        except Exception as exc:  # any failure leaves the XLA backend in charge
            error = f"the native CPU kernels are unavailable: {exc}"
        _state["error"] = error
        return error


def require(key: str) -> None:
    """Build and register the kernels if needed; a RuntimeError naming the config key
    (`executor.attention` or `executor.matmul`) when they are unavailable."""
    error = ensure_registered()
    if error is not None:
        raise RuntimeError(f"{key}=native: {error}")


def tile_columns() -> int:
    """The matmul kernels' column tile (registered kernels only)."""
    return _state["tile_columns"]  # type: ignore[return-value]
