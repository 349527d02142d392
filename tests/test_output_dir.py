"""An output folder that cannot be written fails in one line; the console still shows the summary."""

import os
import shutil
import subprocess
import sys

import pytest

from conftest import REPO, cbjax_cmd
from cbjax.report.files import RequestLog, unwritable

RUN = ["progress=false", "workload.num_requests=6", "executor.cost_model=unit"]

# `cbjax` whose run folder is replaced by a regular file once serving is done, right before
# the run writes its files (the folder vanished and something else took its name).
VANISHING = """
import shutil, sys
from pathlib import Path
import cbjax.app.run
real = cbjax.app.run.write_service_series
def vanish_then_write(out_dir, rows):
    shutil.rmtree(out_dir)
    Path(out_dir).write_text("not a folder")
    return real(out_dir, rows)
cbjax.app.run.write_service_series = vanish_then_write
from cbjax.app.cli import main
sys.argv = ["cbjax", *sys.argv[1:]]
main()
"""


def blocked(tmp_path):
    """A path no one can create, root included: it lies under a regular file."""
    (tmp_path / "file").write_text("x")
    return tmp_path / "file" / "out"


def test_an_unwritable_run_folder_fails_in_one_line_before_the_run(tmp_path, env_cpu):
    out = blocked(tmp_path)
    proc = subprocess.run(cbjax_cmd() + RUN + [f"hydra.run.dir={out}"], env=env_cpu, capture_output=True, text=True,
                          timeout=120)  # fmt: skip
    assert proc.returncode == 1
    assert proc.stderr.splitlines() == [
        f"cbjax: error: cannot write the output folder {out}: Not a directory; "
        "choose another with hydra.run.dir (or hydra.sweep.dir)"
    ]
    assert "throughput" not in proc.stdout  # nothing ran


def test_the_profiler_with_an_unwritable_run_folder_fails_in_one_line_before_timing(tmp_path, env_cpu):
    out = blocked(tmp_path)
    cmd = [sys.executable, "-m", "cbjax.profile", "grid=small", "repeats=1", f"hydra.run.dir={out}"]
    proc = subprocess.run(cmd, env=env_cpu, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    assert proc.stderr.splitlines() == [
        f"cbjax.profile: error: cannot write the output folder {out}: Not a directory; "
        "choose another with hydra.run.dir (or hydra.sweep.dir)"
    ]
    assert "timing" not in proc.stdout  # nothing was timed


def test_a_sweep_folder_that_cannot_be_written_fails_in_one_line(tmp_path, env_cpu):
    out = blocked(tmp_path)
    proc = subprocess.run(cbjax_cmd() + ["-m", *RUN, "seed=0,1", f"hydra.sweep.dir={out}"], env=env_cpu,
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert proc.returncode == 1 and len(proc.stderr.splitlines()) == 1
    assert proc.stderr.startswith(f"cbjax: error: cannot write the output folder {out}: ")


def test_a_folder_lost_during_the_run_fails_in_one_line_after_the_summary(tmp_path, env_cpu):
    out = tmp_path / "run"
    env = dict(env_cpu, PYTHONPATH=str(REPO))
    proc = subprocess.run([sys.executable, "-c", VANISHING, *RUN, f"hydra.run.dir={out}"], env=env,
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert proc.returncode == 1
    assert "| throughput" in proc.stdout and "| requests (finished / rejected) | 6 (6 / 0)" in proc.stdout
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("cbjax: error: ") and str(out / "client_service.csv") in lines[0]
    assert out.read_text() == "not a folder"


def test_the_check_and_the_live_log_tolerate_a_lost_folder(tmp_path):
    assert unwritable(tmp_path / "new" / "dir") is None and (tmp_path / "new" / "dir").is_dir()
    assert "Not a directory" in unwritable(blocked(tmp_path))
    folder = tmp_path / "live"
    live = RequestLog(folder / "requests.jsonl", lambda r: {})
    shutil.rmtree(folder)
    folder.write_text("not a folder")
    live.close()  # no error: the partial log is gone with its folder


def test_write_run_names_the_folder_it_cannot_write(tmp_path):
    from cbjax.report.files import OutputError
    from cbjax.report.tables import write_run

    out = blocked(tmp_path)
    with pytest.raises(OutputError, match=f"^cannot write the output folder {out}: Not a directory$"):
        write_run(out, {"seed": 0}, {"num_requests": 0}, [])


@pytest.mark.parametrize("prog", ["cbjax-serve", "cbjax-bench"])
def test_the_server_and_the_client_fail_in_one_line_on_an_unwritable_folder(tmp_path, env_cpu, prog):
    out = blocked(tmp_path)
    module = {"cbjax-serve": "cbjax.serve", "cbjax-bench": "cbjax.bench"}[prog]
    proc = subprocess.run([sys.executable, "-m", module, "server.port=0" if prog == "cbjax-serve" else "progress=false",
                           f"hydra.run.dir={out}"], cwd=REPO, env=env_cpu, capture_output=True, text=True, timeout=120)  # fmt: skip
    assert proc.returncode == 1
    assert proc.stderr.splitlines() == [
        f"{prog}: error: cannot write the output folder {out}: Not a directory; "
        "choose another with hydra.run.dir (or hydra.sweep.dir)"
    ]


@pytest.mark.parametrize("config", ["serve", "bench"])
def test_server_and_client_runs_get_folders_of_their_own(config):
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    import cbjax.app.cli  # noqa: F401  registers ${cbjax.run_id:}
    import cbjax.bench.cli  # noqa: F401  the configs' schemas
    import cbjax.serve.cli  # noqa: F401

    with initialize_config_dir(config_dir=str(REPO / "configs"), version_base="1.3"):
        cfg = compose(config_name=config, return_hydra_config=True)
    run_dir = OmegaConf.to_container(cfg.hydra.run, resolve=True)["dir"]
    assert run_dir.startswith(f"outputs/{config}/") and f"_{os.getpid()}-" in run_dir  # as cbjax's run_id
