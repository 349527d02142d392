"""The device seam's registry: backends by name, and the native package as an optional plugin."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from conftest import REPO
from cbjax.kernels import registry


def _run(code: str) -> subprocess.CompletedProcess:
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO), "JAX_PLATFORMS": "cpu"}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env, cwd=REPO)


def test_without_the_native_package_auto_runs_ragged_and_xla_with_one_notice_line():
    # sys.modules[name] = None: importing the package fails as if it were deleted
    code = (
        "import sys, json; sys.modules['cbjax.kernels.native'] = None\n"
        "from cbjax.kernels.registry import resolve_attention, resolve_matmul, GROUPED\n"
        "print(json.dumps([resolve_attention('auto', 'cpu'), resolve_matmul('auto', 'float32', False, 'cpu'),\n"
        "                  resolve_attention('auto', 'gpu'), 'native' in GROUPED]))\n"
        "for impl, fn in (('native', resolve_attention), ('native', resolve_matmul)):\n"
        "    try:\n"
        "        fn(impl, backend='cpu')\n"
        "    except ValueError as e:\n"
        "        print(e)\n"
    )
    out = _run(code)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert json.loads(lines[0]) == ["ragged", "xla", "pallas", False]
    assert lines[1] == ("executor.attention=native: not available (the optional kernel package "
                        "cbjax.kernels.native is not installed)")  # fmt: skip
    assert lines[2].startswith("executor.matmul=native: not available")
    notices = [ln for ln in out.stderr.splitlines() if ln.startswith("cbjax:")]
    assert notices == ["cbjax: the optional kernel package cbjax.kernels.native is not installed: "
                       "executor.attention=auto runs `ragged` and executor.matmul=auto runs `xla` on this CPU"]  # fmt: skip


def test_a_broken_dependency_of_the_package_is_not_mistaken_for_its_absence(monkeypatch):
    # a ModuleNotFoundError for another module (a missing dependency) is raised, not swallowed
    def broken(name):
        raise ModuleNotFoundError("No module named 'somedep'", name="somedep")

    monkeypatch.setattr(registry.importlib, "import_module", broken)
    registry.load_plugins.cache_clear()
    try:
        with pytest.raises(ModuleNotFoundError, match="somedep"):
            registry.load_plugins()
    finally:
        monkeypatch.undo()
        registry.load_plugins.cache_clear()
        registry.load_plugins()


def test_unknown_and_unresolved_names_are_refused_by_key():
    with pytest.raises(ValueError, match="executor.attention: unknown value 'flash'"):
        registry.resolve_attention("flash", "cpu")
    with pytest.raises(ValueError, match="executor.attention=triton: it needs a GPU"):
        registry.resolve_attention("triton", "cpu")
    with pytest.raises(ValueError, match="executor.attention: 'auto' is not a registered backend"):
        registry.attention_op("auto")
    with pytest.raises(ValueError, match="executor.matmul: 'auto' is not a registered implementation"):
        registry.layer_ops("auto")
    assert registry.resolve_attention("reference", "cpu") == "reference"
    assert "ragged" in registry.GROUPED and "pallas" not in registry.GROUPED


@pytest.mark.parametrize("page_size, head_dim, field", [(16, 24, "model.head_dim 24"), (8, 64, "cache.page_size 8")])
def test_on_a_gpu_pallas_refuses_at_startup_shapes_triton_cannot_lower(page_size, head_dim, field):
    """The GPU Pallas kernel lowers through Triton, which needs page_size and head_dim powers of
    two >= 16: an explicit pallas or triton names the field when the executor resolves it, and
    auto runs ragged instead (a model with head_dim 24 serves on a GPU)."""
    shapes = dict(page_size=page_size, head_dim=head_dim)
    for impl in ("pallas", "triton"):
        with pytest.raises(ValueError, match=f"executor.attention={impl}: .*{field}"):
            registry.resolve_attention(impl, "gpu", **shapes)
    assert registry.resolve_attention("auto", "gpu", **shapes) == "ragged"
    assert registry.resolve_attention("auto", "gpu", page_size=16, head_dim=64) == "pallas"
    assert registry.resolve_attention("pallas", "cpu", **shapes) == "pallas"  # interpret mode lowers any shape
