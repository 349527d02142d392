"""The layout modules (token buckets, attention groups) sit where both sides import them: the
simulator imports them without jax and without cbjax's XLA flags."""

from __future__ import annotations

import json
import subprocess
import sys

from conftest import REPO


def test_importing_the_simulator_imports_no_jax_and_sets_no_xla_flags():
    code = (
        "import json, os, sys; before = os.environ.get('XLA_FLAGS');"
        "import cbjax.sim, cbjax.sim.profiled, cbjax.layout.shapes, cbjax.layout.tiles;"
        "print(json.dumps({'jax': 'jax' in sys.modules, 'runtime': 'cbjax.runtime' in sys.modules,"
        " 'flags_changed': os.environ.get('XLA_FLAGS') != before}))"
    )
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO)}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env, cwd=REPO)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == {"jax": False, "runtime": False, "flags_changed": False}


def test_the_engine_side_still_sets_its_flags():
    # the check above can fail: importing the engine's runtime sets XLA_FLAGS (where cbjax's
    # defaults apply to this jaxlib)
    code = ("import os; from cbjax.runtime.xla_defaults import apply; expected = bool(apply({}));"
            "import cbjax.runtime; print((os.environ.get('XLA_FLAGS') is not None) == expected)")
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO)}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env, cwd=REPO)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "True"
