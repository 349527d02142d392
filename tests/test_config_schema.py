"""Config correctness: experiment keys take effect, unknown `+` keys fail, arms merge typed,
YAML groups hold only changes, and choice lists come from their registries."""

import dataclasses

import pytest
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException
from omegaconf import OmegaConf

from conftest import REPO
import cbjax.app.cli  # noqa: F401  registers the RunConfig schema with Hydra
from cbjax import config as C
from cbjax.app.config_merge import to_run_config
from cbjax.app.run import run_experiment

CONFIGS = REPO / "configs"
GROUP_SCHEMAS = {
    "scheduler": C.SchedulerConfig,
    "cache": C.CacheConfig,
    "executor": C.ExecutorConfig,
    "workload": C.WorkloadConfig,
    "model": C.ModelConfig,
    "hardware": C.HardwareConfig,
    "overhead": C.OverheadConfig,
}


def composed(*overrides):
    with initialize_config_dir(config_dir=str(CONFIGS), version_base="1.3"):
        return to_run_config(compose(config_name="config", overrides=list(overrides)))


def leaves(node, prefix=""):
    """(dotted key, value) for every leaf of a plain nested dict, list items by index (`a.0.b`);
    dicts under experiment are leaves."""
    items = enumerate(node) if isinstance(node, list) else node.items()
    for key, value in items:
        path = f"{prefix}{key}"
        if isinstance(value, (dict, list)) and value and not path.startswith("experiment."):
            yield from leaves(value, path + ".")
        else:
            yield path, value


def lookup(cfg, dotted):
    for key in dotted.split("."):
        if isinstance(cfg, (list, tuple)):
            cfg = cfg[int(key)]
        else:
            cfg = cfg[key] if isinstance(cfg, dict) else getattr(cfg, key)
    return cfg


@pytest.mark.parametrize("path", sorted((CONFIGS / "experiment").glob("*.yaml")), ids=lambda p: p.stem)
def test_every_key_of_every_experiment_config_takes_effect(path):
    raw = OmegaConf.to_container(OmegaConf.load(path))
    raw.pop("defaults", None)
    keys = list(leaves(raw))
    assert keys, f"{path.name} sets no keys"
    cfg = composed(f"experiment={path.stem}")
    for key, value in keys:
        got = lookup(cfg, key)
        assert got == value, f"{path.name}: {key} is {got!r} after composing, the file sets {value!r}"


def test_the_static_vs_continuous_window_is_the_experiments_not_the_roots():
    assert composed().window_iterations == 1000
    assert composed("experiment=static_vs_continuous").window_iterations == 2000


def test_a_plus_key_outside_the_schema_fails_naming_it():
    with pytest.raises(ValueError, match=r"unknown key scheduler\.max_num_seq; did you mean scheduler\.max_num_seqs"):
        composed("+scheduler.max_num_seq=4")
    with pytest.raises(ValueError, match=r"unknown key windw_iterations"):
        composed("+windw_iterations=5")
    with pytest.raises(ValueError, match=r"unknown key workload\.prompt_len\.meen"):
        composed("+workload.prompt_len.meen=5")
    assert composed("scheduler.max_num_seqs=4").scheduler.max_num_seqs == 4


def test_a_wrong_type_in_an_arm_fails_like_one_on_the_command_line():
    with pytest.raises(ConfigCompositionException) as cli_err:
        composed("scheduler.max_num_seqs=many")
    cli_msg = str(cli_err.value.__cause__ or cli_err.value)
    assert "could not be converted to Integer" in cli_msg
    cfg = dataclasses.replace(
        composed("progress=false", "workload.num_requests=4"),
        experiment=C.ExperimentConfig(name="bad", arms={"ok": {}, "bad": {"scheduler": {"max_num_seqs": "many"}}}),
    )
    with pytest.raises(ValueError, match=r"experiment\.arms\.bad: scheduler\.max_num_seqs: .*could not be converted to Integer"):
        run_experiment(cfg, verbose=False)
    # a string that is an integer converts, as it does on the command line
    cfg = dataclasses.replace(cfg, experiment=C.ExperimentConfig(name="ok", arms={"a": {"scheduler.max_num_seqs": "3"}}))
    summaries = run_experiment(cfg, verbose=False)
    assert summaries["a"]["num_slots"] == 3


@pytest.mark.parametrize("group", sorted(GROUP_SCHEMAS))
def test_group_yaml_files_hold_only_what_differs_from_the_dataclass_defaults(group):
    cls = GROUP_SCHEMAS[group]
    defaults = OmegaConf.to_container(OmegaConf.structured(cls))
    for path in sorted((CONFIGS / group).glob("*.yaml")):
        raw = OmegaConf.to_container(OmegaConf.load(path)) or {}
        raw.pop("defaults", None)
        for key, value in leaves(raw):
            default = lookup(defaults, key)
            assert value != default, f"{group}/{path.name}: {key}: {value!r} is the dataclass default"


def test_choice_lists_come_from_the_registries(monkeypatch):
    from cbjax.cache import allocator
    from cbjax.app.choices import check_choices
    from cbjax.scheduler.policy import POLICIES, FCFSPolicy
    from cbjax.sim.cost import COST_MODELS, UnitCost

    def run(**groups):
        return C.RunConfig(**{key: cls(**{field: "mine"}) for key, (cls, field) in groups.items()})

    policy = dict(scheduler=(C.SchedulerConfig, "name"))
    cost = dict(executor=(C.ExecutorConfig, "cost_model"))
    for make in (lambda: check_choices(run(**policy)), lambda: C.CacheConfig(allocation="mine"),
                 lambda: check_choices(run(**cost))):  # fmt: skip
        with pytest.raises(ValueError, match="unknown value 'mine'"):
            make()
    monkeypatch.setitem(POLICIES, "mine", FCFSPolicy)
    monkeypatch.setattr(allocator, "ALLOCATIONS", allocator.ALLOCATIONS + ("mine",))
    monkeypatch.setitem(COST_MODELS, "mine", lambda model, hw: UnitCost())
    assert check_choices(run(**policy)).scheduler.name == "mine"
    assert C.CacheConfig(allocation="mine").allocation == "mine"
    assert check_choices(run(**cost)).executor.cost_model == "mine"
    with pytest.raises(ValueError, match=r"scheduler\.name: unknown value 'nope'; choose one of .*mine"):
        check_choices(C.RunConfig(scheduler=C.SchedulerConfig(name="nope")))
