"""cbjax's XLA:CPU flag defaults: added once, never over the user's, off with CBJAX_XLA_DEFAULTS=0."""

from __future__ import annotations

import os
import subprocess
import sys
from importlib import metadata

import pytest

from cbjax.runtime import xla_defaults

FLAG = "--xla_cpu_experimental_ynn_fusion_type="
CHECKED = metadata.version("jaxlib").startswith(xla_defaults._CHECKED_JAXLIB)


@pytest.mark.skipif(not CHECKED, reason="flag defaults apply only to the jaxlib versions they were checked on")
def test_adds_the_flag_once_and_keeps_the_users_flags():
    env = {"XLA_FLAGS": "--xla_force_host_platform_device_count=8"}
    assert xla_defaults.apply(env) == [FLAG]
    assert env["XLA_FLAGS"] == "--xla_force_host_platform_device_count=8 " + FLAG
    assert xla_defaults.apply(env) == []  # already there
    assert env["XLA_FLAGS"].count("ynn_fusion_type") == 1


def test_never_overrides_a_users_value_and_can_be_turned_off():
    env = {"XLA_FLAGS": "--xla_cpu_experimental_ynn_fusion_type=dot"}
    xla_defaults.apply(env)
    assert env["XLA_FLAGS"] == "--xla_cpu_experimental_ynn_fusion_type=dot"
    off = {"CBJAX_XLA_DEFAULTS": "0"}
    assert xla_defaults.apply(off) == [] and "XLA_FLAGS" not in off


@pytest.mark.skipif(not CHECKED, reason="flag defaults apply only to the jaxlib versions they were checked on")
def test_this_jaxlib_accepts_the_flag():
    """XLA aborts the process on an unknown flag: start a backend with it in a subprocess."""
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "CBJAX_XLA_DEFAULTS")}
    env["JAX_PLATFORMS"] = "cpu"
    code = (
        "import os, cbjax.runtime, jax.numpy as jnp; print(os.environ['XLA_FLAGS']); "
        "print(float((jnp.ones((4, 4)) @ jnp.ones(4)).sum()))"
    )
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == [FLAG, "16.0"]


def test_the_scheduler_side_sets_no_flags():
    """Only the engine (cbjax.runtime) applies the flags; config, scheduler and simulator do not."""
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "CBJAX_XLA_DEFAULTS")}
    code = "import os, cbjax.config, cbjax.scheduler, cbjax.sim, cbjax.app.run; print(os.environ.get('XLA_FLAGS', 'unset'))"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["unset"]
