"""`python -m cbjax.profile` in process on a cut-down grid: it times the real engine and writes a
profile the simulator loads; its Hydra config composes from the `cbjax` groups."""

from __future__ import annotations

import json

from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from cbjax.app.cli import CONFIG_DIR
from cbjax.config import CacheConfig, ExecutorConfig, ModelConfig, SchedulerConfig
from cbjax.profile.anchor import anchor_config
from cbjax.profile.copies import fit_served_copies
from cbjax.profile.runner import ProfileRunConfig, run_profile
from cbjax.profile.serving import serving_runs
from cbjax.profile.wake import MIN_WAKE_REQUESTS, fit_wake
from cbjax.sim import make_cost_model
from cbjax.sim.profiled import LOOP_TERMS, OPTIONAL_TERMS, SERVE_TERMS, STEP_TERMS, SWAP_DIRECTION_TERMS, SWAP_TERMS


def test_profile_yaml_composes_into_the_profile_config():
    import cbjax.profile.__main__  # noqa: F401  registers profile_base_config

    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        cfg = OmegaConf.to_object(compose("profile", overrides=["grid=small", "repeats=2", "model.max_model_len=128"]))
    assert isinstance(cfg, ProfileRunConfig)
    assert (cfg.grid, cfg.repeats, cfg.executor.name, cfg.model.max_model_len) == ("small", 2, "jax", 128)


def test_profile_times_the_engine_and_writes_a_profile_the_simulator_loads(tmp_path):
    # test_engine's shapes (tiny model, 128 tokens, buckets 4/16/64): few compiles, shared in process
    cfg = ProfileRunConfig(
        model=ModelConfig(max_model_len=128),
        scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64),
        cache=CacheConfig(num_pages=512, page_size=4),
        executor=ExecutorConfig(name="jax", token_buckets=[4, 16, 64]),
        grid="small", repeats=2, serving_rounds=2, serving_min_s=0.0, progress=False,
    )  # fmt: skip
    run_profile(cfg, tmp_path)
    profile = json.loads((tmp_path / "profile.json").read_text())
    assert (tmp_path / "profile.png").stat().st_size > 0
    made = profile["made_for"]
    assert (
        made["model.max_model_len"],
        made["cache.page_size"],
        made["scheduler.max_num_seqs"],
        profile["num_pages"],
    ) == (128, 4, 4, 512)
    coef = profile["coefficients"]
    terms = STEP_TERMS + SERVE_TERMS + SWAP_TERMS + SWAP_DIRECTION_TERMS + LOOP_TERMS + tuple(OPTIONAL_TERMS)
    # drain_s: the pipelined served runs' last steps are collected with nothing launched behind them
    terms += ("drain_s",)
    assert set(coef) == {"bucket_s", "served_bucket_s", *terms} and set(coef["bucket_s"]) == {"4", "16", "64"}
    assert set(coef["served_bucket_s"]) <= {"4", "16", "64"}
    assert all(v >= 0 for v in [*coef["bucket_s"].values(), *coef["served_bucket_s"].values(), *(coef[k] for k in terms)])
    assert {s["bucket"] for s in profile["steps"]} == {4, 16, 64} and all(s["measured_s"] > 0 for s in profile["steps"])
    assert {s["direction"] for s in profile["swaps"]} == {"out", "in"}
    # the host tier's copies timed while serving its sessions workload: each step that stored or
    # loaded pages, and the direction terms fitted on them where there were enough
    copies = profile["served_copies"]
    assert copies and all((r["stores"] or r["loads"]) and r["measured_s"] > 0 for r in copies)
    served_fit = fit_served_copies(copies)
    assert all(coef[k] == v for k, v in served_fit.items())
    # the wake: lone requests served after an idle loop in each of the 2 serving rounds (two
    # passes a round), their TTFT beyond the simulator's with no wake, and the wake terms fitted on them
    lone = [r for r in profile["served_wake"]["requests"] if r["wake_extra_s"] is not None]
    assert len(lone) >= MIN_WAKE_REQUESTS and all(r["ttft_s"] > 0 and r["idle_s"] > 0 for r in lone)
    assert {r["pass"] for r in profile["served_wake"]["requests"]} == {0, 1, 2, 3}
    assert all(r["ttft_s"] - r["predicted_s"] == r["wake_extra_s"] for r in lone)
    wake = fit_wake([r["idle_s"] for r in lone], [r["prompt_len"] for r in lone], [r["wake_extra_s"] for r in lone])
    assert all(coef[k] == v for k, v in wake.items())
    # the served runs: every iteration timed, the loop's time between them, in the runs' makespans
    # (bursts under fcfs and static, and one behind shared prefixes with the prefix cache on,
    # then Poisson arrivals at shares of the first burst's rate; the fit leaves out the
    # iterations after an idle loop)
    runs = ["fcfs_chunked_on", "fcfs_chunked_off", "static", "fcfs_prefix",
            "fcfs_poisson_30pct", "fcfs_poisson_60pct", "fcfs_poisson_90pct"]  # fmt: skip
    assert [(run["round"], run["run"]) for run in profile["serving"]] == [(r, name) for r in (0, 1) for name in runs]
    for run in profile["serving"]:
        assert run["iterations"] > 0 and run["makespan_s"] >= run["execute_s"] + run["loop_s"] > 0
    assert len(profile["served"]) == sum(run["iterations"] for run in profile["serving"])
    # round 1 of 2 is held out of the fit: the fit's residuals count round 0's non-idle steps, the
    # table by regime round 1's (other requests: its own seeds), every regime they served
    assert [s["held_out"] for s in profile["served"]] == [s["round"] == 1 for s in profile["served"]]
    fitted = [s for s in profile["served"] if not s["idle"] and not s["held_out"]]
    held = [s for s in profile["served"] if not s["idle"] and s["held_out"]]
    assert profile["residuals"]["served"]["num_points"] == len(fitted) > 0
    table = profile["residuals"]["by_regime"]
    assert table["steps"] == "held-out"
    assert set(table["regimes"]) == {s["regime"] for s in held} <= {"burst", "light", "medium", "heavy"}
    assert sum(r["num_steps"] for r in table["regimes"].values()) == len(held) > 0
    # the product's defaults: served per-row, per-page and cold terms, the mean_relative weighting
    assert (profile["served_terms"], profile["fit_cold"], profile["served_weighting"]) == (True, True, "mean_relative")
    assert isinstance(profile["gaps"], list)  # recorded for `cbjax.profile.refit` (none when pipelined)
    # every pipelined point records the engine's step call of the launch after it
    launched = [s for s in profile["served"] if "host_s" in s]
    assert launched and all(s["next_dispatch_s"] > 0 for s in launched)
    # the anchor: round 0's whole-prompt fcfs burst (3 x 4 requests), timed before each of the 2
    # rounds and after the last; its reference is their median, and the record rebuilds the run
    anchor = profile["anchor"]
    assert len(anchor["timings_s"]) == 3 and anchor["reference_s"] == sorted(anchor["timings_s"])[1] > 0
    rebuilt = anchor_config(cfg, json.loads(json.dumps(anchor)))
    (original,) = [c for label, c in serving_runs(cfg, None, 0) if label == "fcfs_chunked_off"]
    assert (rebuilt.scheduler, rebuilt.workload, rebuilt.seed) == (original.scheduler, original.workload, original.seed)
    assert (rebuilt.scheduler.name, rebuilt.scheduler.chunked_prefill, rebuilt.workload.num_requests) == ("fcfs", False, 12)
    assert profile["machine"]["backend"] == "cpu" and profile["machine"]["jax"]
    assert 0.0 <= profile["machine"]["others_cpu_share"] <= 1.0  # read from /proc/stat on Linux
    assert 0 <= profile["residuals"]["median_rel_error"] <= profile["residuals"]["max_rel_error"]
    sim = ExecutorConfig(cost_model="profiled", profile=str(tmp_path / "profile.json"), token_buckets=[4, 16, 64])
    cost = make_cost_model("profiled", cfg.model, None, scheduler=cfg.scheduler, cache=cfg.cache, executor=sim)
    assert cost.shapes.token_buckets == (4, 16, 64)


def test_the_command_it_prints_simulates_the_model_it_profiled():
    """The profile matches one model, page size and slot count; the simulator's default model is
    another, so the printed command names them as the profile was made."""
    from pathlib import Path

    import cbjax.app.cli  # noqa: F401  registers the base config
    from cbjax.app.config_merge import to_run_config
    from cbjax.profile.__main__ import use_command
    from cbjax.sim.profiled import profile_key

    made_with = ["grid=small", "model.max_model_len=128", "cache.page_size=4", "scheduler.max_num_seqs=4", "repeats=2"]
    command = use_command("tiny", made_with, Path("out/profile.json"))
    assert command == (
        "cbjax model=tiny model.max_model_len=128 cache.page_size=4 scheduler.max_num_seqs=4 executor=sim "
        "executor.cost_model=profiled executor.profile=out/profile.json"
    )
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        made = OmegaConf.to_object(compose("profile", overrides=made_with))
        run = to_run_config(compose("config", overrides=command.split()[1:]))
    key = lambda c: profile_key(c.model, c.cache.page_size, c.scheduler.max_num_seqs)  # noqa: E731
    assert key(run) == key(made)
    assert use_command("hf", ["model=hf", "model.path=/m"], Path("p.json")).startswith("cbjax model=hf model.path=/m executor=sim ")
