"""`python -m cbjax.profile`: a Hydra app over the `cbjax` config groups (configs/profile.yaml)."""

from __future__ import annotations

import signal
import sys
from pathlib import Path

import hydra
from hydra.core.config_store import ConfigStore
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from cbjax.app.cli import CONFIG_PATH, preflight
from cbjax.app.config_merge import typed_config
from cbjax.profile.runner import ProfileRunConfig

ConfigStore.instance().store(name="profile_base_config", node=ProfileRunConfig)


@hydra.main(version_base="1.3", config_path=CONFIG_PATH, config_name="profile")  # as cbjax: a checkout's or the wheel's
def _app(cfg: DictConfig) -> None:
    import cbjax.runtime  # noqa: F401  XLA flag defaults before jax starts
    from cbjax.profile.runner import run_profile

    out_dir = Path(HydraConfig.get().runtime.output_dir)
    try:
        run_cfg = typed_config(cfg, ProfileRunConfig)
        profile = run_profile(run_cfg, out_dir)
    except ValueError as err:
        print(f"cbjax.profile: error: {err}", file=sys.stderr)
        sys.exit(2)
    except OSError as err:  # profile.json could not be written (OutputError names it)
        print(f"cbjax.profile: error: {err}", file=sys.stderr)
        sys.exit(1)
    except KeyboardInterrupt as err:  # SIGINT, or SIGTERM (`_terminate`): profile.json is written last, whole
        by = err.args[0] if err.args else "SIGINT"
        print(f"cbjax.profile: interrupted by {by}; no new profile written to {out_dir}", file=sys.stderr)
        sys.exit(130)
    c, r = profile["coefficients"], profile["residuals"]
    print("bucket_s (grid, all padding): " + ", ".join(f"{b}:{1e3 * v:.2f}ms" for b, v in c["bucket_s"].items()))
    print("served_bucket_s: " + ", ".join(f"{b}:{1e3 * v:.2f}ms" for b, v in c["served_bucket_s"].items()))
    print("coefficients: " + ", ".join(f"{k}={v:.3g}" for k, v in c.items() if not k.endswith("bucket_s")))
    print(
        f"fit: median relative error {r['median_rel_error']:.1%}, max {r['max_rel_error']:.1%} over {r['num_points']} grid steps"
    )
    if "served" in r:
        sv = r["served"]
        print(f"served: median relative error {sv['median_rel_error']:.1%} over {sv['num_points']} iterations; "
              f"their total time (steps + loop) predicted {sv['total_error']:+.1%}")  # fmt: skip
    m = profile["machine"]
    cores, others = m["cores"] or 1, m.get("others_cpu_share")
    grid_gap = r.get("served", {}).get("grid_model_total_error", 0.0)
    if others is not None:
        print(f"other processes took {others:.0%} of the {cores} cores while it ran")
        busy = others > 0.2
    else:  # no /proc/stat: the load average before it started
        load = m.get("load_average_at_start", m["load_average"])[0]
        print(f"machine load average before profiling: {load:.2f} on {cores} cores")
        busy = load > 0.5 * cores
    if busy or abs(grid_gap) > 0.25:
        print(f"warning: a busy machine? the grid model (steps back to back) puts the served steps {grid_gap:+.0%} off. "
              "Profile again on a quiet machine.")  # fmt: skip
    from cbjax.profile.anchor import SPEED_TOLERANCE, spread, steady
    from cbjax.profile.served_fit import HELD_CALL
    from cbjax.profile.residuals import format_table

    table = r["by_regime"]
    print(f"served step time by regime and bucket, on the {table['steps']} served steps (+: over-predicted):\n"
          + "\n".join(format_table(table)))  # fmt: skip
    for line in table["sparse"] + table["failures"]:
        print(("FAIL: " if line in table["failures"] else "under-sampled: ") + line)
    machine = table.get("machine") or {}
    if machine.get("spread") is not None:
        speeds = ", ".join(f"round {r} {x['speed']:.2f}" for r, x in machine["rounds"].items())
        print(f"machine speed by serving round (predicted / measured step time): {speeds}; spread {machine['spread']:.0%}")
        if machine["drifted"]:
            print("  the machine ran at different speeds in different rounds: the table above measures that "
                  "drift (fitted rounds against held-out ones) as well as the model")  # fmt: skip
    anchor = profile.get("anchor")
    if anchor:
        lo, hi = spread(anchor)
        print(f"anchor (machine speed, `cbjax.profile.anchor`): {1e3 * anchor['reference_s']:.1f} ms, timings "
              f"{lo:.2f}-{hi:.2f} of it before and after the rounds")  # fmt: skip
        if not steady(anchor):
            print(f"  the machine's speed moved by more than {2 * SPEED_TOLERANCE:.0%} while profiling: its fit blends "
                  "speeds. Profile again on a steadier machine.")  # fmt: skip
    launch = r.get("launch") or {}
    parts = [
        f"{n} {launch[k]['num_steps']} steps, mean signed {launch[k]['mean_signed_error']:+.1%}"
        for k, n in (("decode", "decodes alone"), ("prefill", "with a prefill")) if launch.get(k, {}).get("num_steps")
    ]  # fmt: skip
    if parts:
        print(f"loop host time before a collect, by the launched plan ({launch['steps']}): " + "; ".join(parts))
    by_regime = [f"{r} {x['num_steps']} steps, mean signed {x['mean_signed_error']:+.1%}"
                 for r, x in (launch.get("prefill_by_regime") or {}).items() if x["num_steps"]]  # fmt: skip
    if by_regime:
        print("  with a prefill, by regime (a new request's first token waits behind one): " + "; ".join(by_regime))
    by_arrivals = [f"{n} {x['num_steps']} steps, mean signed {x['mean_signed_error']:+.1%}"
                   for k, n in (("none", "none"), ("some", "one or more"))
                   if (x := (launch.get("prefill_by_arrivals") or {}).get(k)) and x["num_steps"]]  # fmt: skip
    if by_arrivals:
        print("  with a prefill, by the arrivals the loop took in before planning it: " + "; ".join(by_arrivals))
    by_call = launch.get("prefill_by_call") or {}
    parts = [f"{n} {x['num_steps']} steps, mean signed {x['mean_signed_error']:+.1%}"
             for k, n in (("held", "held the loop while the step ran"), ("queued", "queued the step"))
             if (x := by_call.get(k)) and x["num_steps"]]  # fmt: skip
    if parts:
        print(f"  with a prefill, by its step call (held: over {HELD_CALL:g} x {1e3 * by_call['floor_s']:.2f} ms): "
              + "; ".join(parts))
    print(f"took {profile['profile_s']:.1f} s (warmup {profile['warmup_s']:.1f} s)")
    print(f"\nprofile: {out_dir / 'profile.json'}")
    hydra_cfg = HydraConfig.get()
    print("use it: " + use_command(hydra_cfg.runtime.choices["model"], list(hydra_cfg.overrides.task), out_dir / "profile.json"))


# The keys a profile must match (`cbjax.sim.profiled.profile_key`), as command-line overrides
MATCHED = ("model", "cache.page_size", "scheduler.max_num_seqs")


def use_command(model: str, overrides: list[str], profile: Path) -> str:
    """The `cbjax` command that simulates with this profile: the model option and the overrides
    of the keys the profile must match, as the profile was made with them (the simulator's own
    default model is another one)."""
    given = [o for o in overrides if o.lstrip("+~").split("=", 1)[0].split(".")[0] == "model"
             or o.lstrip("+~").split("=", 1)[0] in MATCHED[1:]]  # fmt: skip
    if not any(o.lstrip("+~").startswith("model=") for o in given):
        given.insert(0, f"model={model}")
    return " ".join(["cbjax", *given, "executor=sim", "executor.cost_model=profiled", f"executor.profile={profile}"])


def _terminate(signum: int, frame) -> None:
    """SIGTERM as Ctrl-C: the profile stops where it is and says so (no half-written files)."""
    raise KeyboardInterrupt(signal.Signals(signum).name)


def main() -> None:
    preflight("cbjax.profile", "profile", ProfileRunConfig)
    signal.signal(signal.SIGTERM, _terminate)
    try:
        _app()
    except KeyboardInterrupt:  # before the profile started (Hydra composing its config)
        print("cbjax.profile: interrupted before the profile started", file=sys.stderr)
        sys.exit(130)


if __name__ == "__main__":
    main()
