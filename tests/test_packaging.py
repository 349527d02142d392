"""The package stands alone: the shipped sample trace, pkg:// paths, and cli.log mirroring the console.
(.ci/wheel_check runs an installed wheel from outside the repository.)"""

import subprocess

import pytest

from conftest import AZURE_TRACE, REPO, cbjax_cmd
from test_config_schema import composed
from cbjax.app.run import run_experiment
from cbjax.workload import build_workload

SAMPLE = "pkg://cbjax.data/AzureLLMInferenceTrace_code_sample.csv"
DATA = REPO / "cbjax" / "data"


def test_the_readme_trace_command_replays_the_shipped_sample(tmp_path):
    cfg = composed("progress=false", "workload=trace", f"workload.path={SAMPLE}", "model=llama3_8b",
                   "cache.num_pages=28000")  # fmt: skip
    summary = run_experiment(cfg, tmp_path, verbose=False)
    assert summary["num_requests"] == 500 and summary["num_finished"] == 500
    reqs = build_workload(cfg.workload, 0)
    # first rows of the file: 2023-11-16 18:17:03.9799600,4808,10 and 18:17:04.0319600,3180,8
    assert [(r.prompt_len, r.target_output_len) for r in reqs[:2]] == [(4808, 10), (3180, 8)]
    assert reqs[1].arrival_s == pytest.approx(0.052)


def test_the_sample_ships_with_its_licence_and_is_the_traces_first_rows():
    assert "Creative Commons Attribution 4.0" in (DATA / "LICENSE-CC-BY-4.0").read_text()
    assert "Microsoft Azure / Splitwise" in (DATA / "README.md").read_text()
    sample = (DATA / "AzureLLMInferenceTrace_code_sample.csv").read_text().splitlines()
    assert sample[0] == "TIMESTAMP,ContextTokens,GeneratedTokens" and len(sample) == 501
    if not AZURE_TRACE.is_file():
        pytest.skip(f"the full trace is not at {AZURE_TRACE}")
    assert AZURE_TRACE.read_text().splitlines()[:501] == sample


def test_a_bad_pkg_path_names_the_field():
    with pytest.raises(ValueError, match=r"workload.path 'pkg://no_such_pkg_xyz/t.csv': no package 'no_such_pkg_xyz'"):
        run_experiment(composed("workload=trace", "workload.path=pkg://no_such_pkg_xyz/t.csv"), verbose=False)
    with pytest.raises(ValueError, match=r"trace file 'pkg://cbjax.data/missing.csv' .* does not exist"):
        run_experiment(composed("workload=trace", "workload.path=pkg://cbjax.data/missing.csv"), verbose=False)


def test_cli_log_holds_what_the_console_showed(tmp_path, env_cpu):
    out = tmp_path / "run"
    cmd = cbjax_cmd() + ["progress=false", "workload.num_requests=8", f"hydra.run.dir={out}"]
    proc = subprocess.run(cmd, env=env_cpu, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "throughput" in proc.stdout and f"outputs: {out}" in proc.stdout
    assert (out / "cli.log").read_text() == proc.stdout
