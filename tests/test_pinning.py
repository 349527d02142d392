"""Pinning a measurement to some cores (cbjax.profile.pinning), each case in a fresh process
so the test process keeps its own affinity."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from conftest import REPO

pytestmark = pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="needs Linux CPU affinity")


def run(code: str) -> dict:
    env = {**os.environ, "PYTHONPATH": str(REPO), "JAX_PLATFORMS": "cpu"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def test_pinning_one_core_pins_every_thread_and_the_threads_started_later():
    got = run(
        "import json, os, threading\n"
        "from cbjax.profile.pinning import allowed_cpus, pin\n"
        "first = allowed_cpus()[0]\n"
        "record = pin(1)\n"
        "seen = []\n"
        "t = threading.Thread(target=lambda: seen.append(sorted(os.sched_getaffinity(0)))); t.start(); t.join()\n"
        "print(json.dumps({'record': record, 'first': first, 'main': sorted(os.sched_getaffinity(0)), 'thread': seen[0]}))"
    )
    assert got["record"] == {"cores": 1, "cpus": [got["first"]]}
    assert got["main"] == got["thread"] == [got["first"]]


def test_unpinned_is_none_and_bad_counts_or_a_started_jax_name_the_key():
    got = run(
        "import json\n"
        "from cbjax.profile.pinning import allowed_cpus, pin\n"
        "errors = []\n"
        "for n in (0, len(allowed_cpus()) + 1):\n"
        "    try: pin(n, key='cores')\n"
        "    except ValueError as e: errors.append(str(e))\n"
        "import jax; jax.numpy.zeros(1).block_until_ready()\n"
        "try: pin(1, key='cores')\n"
        "except ValueError as e: errors.append(str(e))\n"
        "print(json.dumps({'none': pin(None), 'errors': errors}))"
    )
    assert got["none"] is None
    assert len(got["errors"]) == 3 and all(e.startswith("cores: ") for e in got["errors"])
    assert "before jax starts" in got["errors"][2]
