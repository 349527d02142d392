"""Every run gets its own output folder, even when two start in the same second."""

import json
import subprocess
import sys

from conftest import REPO

# `cbjax` with Hydra's clock frozen, so both runs resolve ${now:} to the same second.
FROZEN_CLI = """
import datetime, sys
import hydra.core.utils
class Frozen(datetime.datetime):
    @classmethod
    def now(cls, tz=None):
        return cls(2026, 1, 2, 3, 4, 5)
hydra.core.utils.datetime = Frozen
from cbjax.app.cli import main
sys.argv = ["cbjax", *sys.argv[1:]]
main()
"""


def test_two_runs_started_in_the_same_second_write_two_folders(tmp_path, env_cpu):
    env = dict(env_cpu, PYTHONPATH=str(REPO))
    cmd = [sys.executable, "-c", FROZEN_CLI, "progress=false", "executor.cost_model=unit"]
    procs = [
        subprocess.Popen(cmd + [f"workload.num_requests={n}"], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
        for n in (5, 7)
    ]  # fmt: skip
    for proc in procs:
        _, err = proc.communicate(timeout=180)
        assert proc.returncode == 0, err
    day = tmp_path / "outputs" / "2026-01-02"
    dirs = sorted(p for p in day.iterdir() if p.is_dir())
    assert len(dirs) == 2, [p.name for p in dirs]
    assert all(p.name.startswith("03-04-05_") for p in dirs)  # the same second, two folders
    counts = []
    for d in dirs:
        assert {"summary.json", "requests.jsonl", "config.yaml", "complete.json"} <= {p.name for p in d.iterdir()}
        summary = json.loads((d / "summary.json").read_text())
        assert len((d / "requests.jsonl").read_text().splitlines()) == summary["num_requests"]
        counts.append(summary["num_requests"])
    assert sorted(counts) == [5, 7]  # each folder holds its own run's results
