"""The Hydra app end to end: typed configs, the acceptance command, outputs, experiments."""

import json
import subprocess
import sys

import pytest
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException

from conftest import REPO, cbjax_cmd
from test_scheduler import list_schedule_finish_times, static_iterations
from cbjax.app.cli import CONFIG_DIR, check_group_overrides, to_run_config
from cbjax.config import RunConfig
from cbjax.app.run import run_experiment, with_overrides

# the tiny model on an A100-80GB: small, fast runs whose page counts the tests set by hand
TINY_RUN = ["progress=false", "model=tiny", "hardware=a100_80gb", "workload.num_requests=24"]


def composed(*overrides):
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        return to_run_config(compose(config_name="config", overrides=list(overrides)))


def write_csv_trace(path, rows):
    path.write_text("arrival_s,prompt_len,output_len\n" + "".join(f"{a},{p},{o}\n" for a, p, o in rows))


@pytest.mark.parametrize("policy", ["fcfs", "static"])
def test_acceptance_command_iterations_equal_the_hand_count(tmp_path, env_cpu, policy):
    outputs = [5, 50, 10, 100, 3, 77, 12, 9, 31, 64, 2, 45, 18, 8, 90, 27, 6, 11]
    trace = tmp_path / "trace.csv"
    write_csv_trace(trace, [(0.0, 10 + i, o) for i, o in enumerate(outputs)])
    out = tmp_path / "run"
    cmd = cbjax_cmd() + [
        "executor=sim", "executor.cost_model=unit", f"scheduler={policy}", "scheduler.max_num_seqs=8",
        "scheduler.max_num_batched_tokens=1000000", "cache.num_pages=100000", "workload=trace",
        f"workload.path={trace}", f"hydra.run.dir={out}",
    ]  # fmt: skip
    proc = subprocess.run(cmd, env=env_cpu, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    summary = json.loads((out / "summary.json").read_text())
    expected = max(list_schedule_finish_times(outputs, 8)) if policy == "fcfs" else static_iterations(outputs, 8)
    assert summary["iterations"] == expected
    assert summary["makespan_s"] == expected  # unit cost: one second per iteration
    rows = [json.loads(line) for line in (out / "requests.jsonl").read_text().splitlines()]
    assert [r["output_len"] for r in rows] == outputs
    assert (out / "config.yaml").is_file()
    assert "throughput" in proc.stdout  # the readable table


def test_every_request_appears_with_its_fate(tmp_path):
    trace = tmp_path / "t.jsonl"
    lines = [
        {"arrival_s": 0.0, "prompt_len": 4, "output_len": 3},
        {"arrival_s": 0.1, "prompt_len": 0, "output_len": 3},  # empty prompt
        {"arrival_s": 0.2, "prompt_len": 4, "max_tokens": 0},  # max_tokens < 1
        {"arrival_s": -1.0, "prompt_len": 4, "output_len": 3},  # negative arrival
        {"arrival_s": 0.3, "prompt_len": 5000, "output_len": 3},  # longer than max_model_len
    ]
    trace.write_text("\n".join(json.dumps(x) for x in lines) + "\n{not json\n")
    cfg = composed("workload=trace", f"workload.path={trace}", "model=tiny", "progress=false")
    summary = run_experiment(cfg, tmp_path / "out", verbose=False)
    rows = {r["request_id"]: r for r in map(json.loads, (tmp_path / "out/requests.jsonl").read_text().splitlines())}
    assert len(rows) == 6 and summary["num_requests"] == 6
    assert rows["0"]["finish_reason"] == "length"
    assert rows["1"]["reject_reason"] == "t.jsonl line 2: empty prompt"  # the scheduler's reason, named by line
    assert rows["2"]["reject_reason"].startswith("t.jsonl line 3: max_tokens must be >= 1")
    assert "arrival_s" in rows["3"]["reject_reason"] and "line 4" in rows["3"]["reject_reason"]
    assert "max_model_len is 1024" in rows["4"]["reject_reason"]
    assert "line 6" in rows["5"]["reject_reason"]
    assert summary["num_rejected"] == 5 and summary["num_finished"] == 1


def test_misspelled_key_and_wrong_type_fail_at_startup_naming_the_key():
    with pytest.raises(ConfigCompositionException) as err:
        composed("scheduler.max_num_seq=4")
    assert "max_num_seq" in str(err.value.__cause__ or err.value)
    with pytest.raises(ConfigCompositionException) as err:
        composed("cache.page_size=big")
    assert "page_size" in str(err.value.__cause__ or err.value)
    with pytest.raises(ConfigCompositionException, match="scheduler/nope"):
        composed("scheduler=nope")
    with pytest.raises(ValueError, match="scheduler.max_num_seqs"):
        composed("scheduler.max_num_seqs=0")


def test_cli_prints_a_clear_error_for_a_bad_value(env_cpu, tmp_path):
    proc = subprocess.run(
        cbjax_cmd() + ["workload.rate=-1", f"hydra.run.dir={tmp_path}"], env=env_cpu, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 2
    assert "cbjax: error: workload.rate must be > 0" in proc.stderr


def test_one_value_for_a_group_of_settings_says_how_to_write_it(env_cpu, tmp_path):
    proc = subprocess.run(
        cbjax_cmd() + ["workload.prompt_len=5000", f"hydra.run.dir={tmp_path}"], env=env_cpu, capture_output=True,
        text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 2
    advice = "workload.prompt_len.dist=fixed workload.prompt_len.value=5000 workload.prompt_len.max=5000"
    assert proc.stderr == (
        f"cbjax: error: workload.prompt_len is a group of settings (LengthConfig), not one value (got 5000); write {advice}\n"
    )
    length = composed(*advice.split()).workload.prompt_len  # the advice composes to 5000-token prompts
    assert (length.dist, length.value, length.max) == ("fixed", 5000, 5000)


def test_any_group_of_settings_given_one_value_is_refused_by_the_cli_and_by_merges(capsys):
    with pytest.raises(SystemExit) as exit_:
        check_group_overrides(["workload=trace", "+slo=0.5"], RunConfig, "cbjax")
    assert exit_.value.code == 2
    assert capsys.readouterr().err == (
        "cbjax: error: slo is a group of settings (SLOConfig), not one value (got 0.5); "
        "write slo.FIELD=VALUE for each field to change (ttft_s, tpot_s)\n"
    )
    check_group_overrides(["workload=trace", "scheduler=static", "workload.prompt_len.value=3"], RunConfig, "cbjax")
    cfg = composed(*TINY_RUN)
    with pytest.raises(ValueError, match=r"^arm: workload\.shared_prefix is a group of settings \(SharedPrefixConfig\), "
                                         r"not one value \(got 3\); write workload\.shared_prefix\.FIELD=VALUE"):  # fmt: skip
        with_overrides(cfg, {"workload": {"shared_prefix": 3}}, where="arm")
    with pytest.raises(ValueError, match=r"workload\.output_len\.dist=fixed workload\.output_len\.value=7 "):
        with_overrides(cfg, {"workload.output_len": 7}, where="arm")


def test_static_vs_continuous_experiment_compares_arms(tmp_path):
    cfg = composed("experiment=static_vs_continuous", *TINY_RUN, "workload.num_requests=200")
    summaries = run_experiment(cfg, tmp_path, verbose=False)
    assert set(summaries) == {"static", "continuous", "continuous_reserve_max"}
    for arm in summaries:
        assert {p.name for p in (tmp_path / arm).iterdir()} >= {"summary.json", "requests.jsonl", "config.yaml"}
    assert (tmp_path / "comparison.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    table = (tmp_path / "comparison.md").read_text()
    assert "continuous / static" in table and "kv_token_utilization" in table
    s, c, r = summaries["static"], summaries["continuous"], summaries["continuous_reserve_max"]
    assert c["throughput_tok_s"] > 2 * s["throughput_tok_s"]
    assert c["slot_utilization"] > s["slot_utilization"]
    assert c["kv_token_utilization"] > 0.9 and r["kv_token_utilization"] < 0.5
    assert c["mean_batch_size"] > r["mean_batch_size"]


def test_with_overrides_rejects_unknown_keys():
    cfg = composed(*TINY_RUN)
    assert with_overrides(cfg, {"scheduler": {"name": "static"}}).scheduler.name == "static"
    assert with_overrides(cfg, {"cache.num_pages": 9}).cache.num_pages == 9
    with pytest.raises(ValueError, match="scheduler.nmae"):
        with_overrides(cfg, {"scheduler": {"nmae": "static"}}, where="arm")


def test_every_config_in_every_group_composes():
    for group in ("scheduler", "executor", "workload", "model", "hardware", "overhead", "cache", "metrics", "experiment"):
        for path in sorted((REPO / "configs" / group).glob("*.yaml")):
            extra = ["workload.path=x.csv"] if path.stem == "trace" else []
            extra = ["model.path=x"] if path.stem == "hf" else extra  # read only when a run starts
            composed(f"{group}={path.stem}", *extra)


def test_swap_preemption_and_prefix_caching_from_the_command_line(tmp_path):
    cfg = composed(*TINY_RUN, "scheduler.preemption=swap", "cache.prefix_caching=true", "cache.num_pages=120")
    assert cfg.cache.swap_capacity == 120 and cfg.hardware.host_bw == 25e9
    summary = run_experiment(cfg, tmp_path, verbose=False)
    assert summary["num_finished"] == 24 and summary["swap_preemptions"] > 0
    assert summary["prefix_cache_hit_rate"] == 0.0  # synthetic prompts share no page
    recompute = run_experiment(with_overrides(cfg, {"scheduler.preemption": "recompute"}), verbose=False)
    assert recompute["preemptions"] > 0 and recompute["swap_preemptions"] == 0
    with pytest.raises(ValueError, match="scheduler.preemption: unknown value 'swapp'"):
        composed("scheduler.preemption=swapp")
    with pytest.raises(ValueError, match="cache.num_swap_pages"):
        composed("cache.num_swap_pages=-1")


def test_library_log_lines_stay_off_stdout(tmp_path, env_cpu):
    """With JAX_PLATFORMS unset, JAX logs its platform probe (e.g. "Unable to initialize backend
    'tpu'") through the root logger; stdout holds only cbjax's table and the outputs line."""
    env = {k: v for k, v in env_cpu.items() if k != "JAX_PLATFORMS"}
    cmd = cbjax_cmd() + [
        "executor=jax", "executor.compilation_cache_dir=null", "executor.token_buckets=[2,16]", "progress=false",
        "scheduler.max_num_batched_tokens=16", "model.max_model_len=64",
        "scheduler.max_num_seqs=2", "workload.num_requests=2", "workload.prompt_len.dist=fixed",
        "workload.prompt_len.value=8", "workload.output_len.dist=fixed", "workload.output_len.value=3",
        f"hydra.run.dir={tmp_path}",
    ]  # fmt: skip
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "throughput" in proc.stdout
    foreign = [line for line in proc.stdout.splitlines() if line and not line.startswith(("|", "outputs: "))]
    assert not foreign, f"not cbjax's lines on stdout: {foreign}"


JOB_LOGGING_CHECK = """
import logging, logging.config, sys, yaml
cfg = yaml.safe_load(open(sys.argv[1]))
cfg["handlers"]["file"]["filename"] = sys.argv[2]
logging.config.dictConfig(cfg)
for name in ("cbjax", "cbjax.serve", "jax._src.xla_bridge", "hydra", "mypolicy"):
    logging.getLogger(name).info(f"{name} info")
    logging.getLogger(name).warning(f"{name} warning")
"""


def test_job_logging_sends_cbjax_to_stdout_and_other_libraries_warnings_to_stderr(tmp_path):
    config = REPO / "configs" / "hydra" / "job_logging" / "cbjax.yaml"
    proc = subprocess.run([sys.executable, "-c", JOB_LOGGING_CHECK, str(config), str(tmp_path / "cli.log")],
                          capture_output=True, text=True, timeout=60, cwd=REPO)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == ["cbjax info", "cbjax warning", "cbjax.serve info", "cbjax.serve warning"]
    assert proc.stderr.splitlines() == ["jax._src.xla_bridge warning", "hydra warning", "mypolicy warning"]
    assert len((tmp_path / "cli.log").read_text().splitlines()) == 10  # every message, INFO up


def test_the_comparison_plot_lays_out_dozens_of_arms(tmp_path):
    """A reproduction runs up to 36 arms: the figure grows a row per arm, so matplotlib's
    layout fits every name instead of warning and overlapping them."""
    import warnings

    from cbjax.report.plots import plot_comparison

    summaries = {}
    for i in range(36):
        arm = f"sharegpt_p{i}_calibrated"
        (tmp_path / arm).mkdir()
        (tmp_path / arm / "requests.jsonl").write_text(json.dumps({"e2e_s": 1.0 + i}) + "\n")
        summaries[arm] = {"throughput_tok_s": 100.0 + i}
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # "Tight layout not applied" is a UserWarning
        path = plot_comparison(tmp_path, summaries)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_latency_cdf_counts_every_submitted_request(tmp_path, monkeypatch):
    """An arm that rejected half its requests has served only half of them by any latency: its
    curve tops out at 0.5, not at 1 as if every request had been served."""
    import matplotlib.axes

    from cbjax.report.plots import plot_comparison

    rows = [
        {"e2e_s": 2.0, "finish_reason": "length"},
        {"e2e_s": None, "finish_reason": "rejected"},
        {"e2e_s": 1.0, "finish_reason": "eos"},
        {"e2e_s": None, "finish_reason": "error"},
    ]
    (tmp_path / "arm").mkdir()
    (tmp_path / "arm" / "requests.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    curves = []
    plot = matplotlib.axes.Axes.plot

    def record(ax, x, y, **kw):
        curves.append(([float(v) for v in x], [float(v) for v in y]))
        return plot(ax, x, y, **kw)

    monkeypatch.setattr(matplotlib.axes.Axes, "plot", record)
    plot_comparison(tmp_path, {"arm": {"throughput_tok_s": 1.0}})
    assert curves == [([1.0, 2.0], [0.25, 0.5])]
