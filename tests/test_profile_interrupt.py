"""`python -m cbjax.profile` stopped by Ctrl-C or SIGTERM: one line, status 130, and no
profile.json (a profile.json is only ever a whole profile). No engine runs: the profile
itself is replaced by one that signals its own process."""

from __future__ import annotations

import subprocess
import sys

import pytest

from cbjax.profile.measure import write_profile

# `python -m cbjax.profile` whose profiling signals this process midway
SIGNALLED = """
import os, signal, sys, time
import cbjax.profile.runner
def signalled(cfg, out_dir):
    os.kill(os.getpid(), getattr(signal, os.environ["PROFILE_SIGNAL"]))
    time.sleep(30)
cbjax.profile.runner.run_profile = signalled
import runpy
sys.argv[0] = "cbjax.profile"
runpy.run_module("cbjax.profile", run_name="__main__")
"""


@pytest.mark.parametrize("sig", ["SIGINT", "SIGTERM"])
def test_a_signalled_profile_says_so_in_one_line_and_writes_no_profile(tmp_path, env_cpu, sig):
    out = tmp_path / "run"
    cmd = [sys.executable, "-c", SIGNALLED, "progress=false", f"hydra.run.dir={out}"]
    proc = subprocess.run(cmd, env=dict(env_cpu, PROFILE_SIGNAL=sig), capture_output=True, text=True, timeout=60)
    assert proc.returncode == 130, proc.stderr
    assert proc.stderr.splitlines() == [f"cbjax.profile: interrupted by {sig}; no new profile written to {out}"]
    assert not (out / "profile.json").exists()


def test_profile_json_is_written_last(tmp_path, monkeypatch):
    # an interrupt while the plot is drawn leaves no profile.json behind
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr("cbjax.profile.measure.plot_profile", interrupted)
    with pytest.raises(KeyboardInterrupt):
        write_profile(tmp_path, {"steps": [], "served": []})
    assert list(tmp_path.iterdir()) == []
