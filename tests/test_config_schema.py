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
    "spec": C.SpecConfig,
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


def registries() -> dict:
    """Each registry-chosen key's registry, read from the registry's own module."""
    from cbjax.cache.allocator import ALLOCATIONS
    from cbjax.cluster.router import ROUTER_CLASSES
    from cbjax.cache.eviction import HOST_EVICTIONS
    from cbjax.engine.clock import PACES
    from cbjax.kernels import registry
    from cbjax.scheduler import POLICIES
    from cbjax.sim.cost import COST_MODELS

    registry.load_plugins()  # the optional kernel packages register their backends
    return {
        "scheduler.name": set(POLICIES),
        "cache.allocation": set(ALLOCATIONS),
        "cache.host_eviction": set(HOST_EVICTIONS),
        "executor.cost_model": set(COST_MODELS),
        "executor.pace": set(PACES),
        "executor.attention": {"auto", *registry._ATTENTION},
        "executor.matmul": {"auto", *registry._OPS},
        "cluster.router": set(ROUTER_CLASSES),
    }


def with_value(key: str, value: str) -> C.RunConfig:
    group, field = key.split(".")
    extra = {"profile": "profile.json"} if (key, value) == ("executor.cost_model", "profiled") else {}
    if key == "cache.allocation" and value != "paged":
        extra = {"prefix_caching": False}  # a reservation cannot share prefix pages
    cls = type(getattr(C.RunConfig(), group))
    return C.RunConfig(**{group: cls(**{field: value, **extra})})


def test_each_registry_chosen_key_accepts_exactly_its_registry_names():
    from cbjax.app.choices import NAMES, check_choices

    expected = registries()
    assert set(NAMES) == set(expected)
    for key, names in expected.items():
        for name in names:
            assert getattr(getattr(check_choices(with_value(key, name)), key.split(".")[0]), key.split(".")[1]) == name
        with pytest.raises(ValueError, match=rf"{key}: unknown value 'nope'; choose one of") as err:
            check_choices(with_value(key, "nope"))
        offered = str(err.value).split("choose one of ")[1].split(", ")
        assert set(offered) == names, key


def test_a_registered_addition_is_selectable(monkeypatch):
    from cbjax.app.choices import check_choices
    from cbjax.cache import allocator
    from cbjax.cache.eviction import HOST_EVICTIONS, LruEviction
    from cbjax.cluster.router import ROUTER_CLASSES, RoundRobin
    from cbjax.engine import clock
    from cbjax.kernels import registry
    from cbjax.scheduler.policy import POLICIES, FCFSPolicy
    from cbjax.sim.cost import COST_MODELS, UnitCost

    monkeypatch.setitem(POLICIES, "mine", FCFSPolicy)
    monkeypatch.setattr(allocator, "ALLOCATIONS", allocator.ALLOCATIONS + ("mine",))
    monkeypatch.setitem(COST_MODELS, "mine", lambda model, hw, run: UnitCost())
    monkeypatch.setattr(clock, "PACES", clock.PACES + ("mine",))
    monkeypatch.setitem(registry._ATTENTION, "mine", registry.AttentionBackend("mine", lambda: None))
    monkeypatch.setitem(registry._OPS, "mine", registry.OpsBackend("mine", lambda: None))
    monkeypatch.setitem(ROUTER_CLASSES, "mine", RoundRobin)
    monkeypatch.setitem(HOST_EVICTIONS, "mine", LruEviction)
    for key in registries():
        group, field = key.split(".")
        assert getattr(getattr(check_choices(with_value(key, "mine")), group), field) == "mine"


def test_a_kernel_plugin_registers_the_names_it_declares():
    # the config accepts a plugin's declared names before it is imported (no jax at startup)
    from cbjax.kernels import registry

    registry.load_plugins()
    for package, names in registry.PLUGINS.items():
        assert package not in registry._missing, package
        assert names["attention"] in registry._ATTENTION and names["matmul"] in registry._OPS


def test_a_negative_seed_and_a_pathless_checkpoint_length_name_their_keys():
    with pytest.raises(ValueError, match=r"^seed must be >= 0, got -1$"):
        C.RunConfig(seed=-1)
    with pytest.raises(ValueError, match=r"^model.max_model_len 0 \(the checkpoint's\) needs model.path; else must be >= 2"):
        C.ModelConfig(max_model_len=0)
    with pytest.raises(ValueError, match=r"^model.dtype auto \(the checkpoint's\) needs model.path, got 'auto'$"):
        C.ModelConfig(dtype="auto")
    with pytest.raises(ValueError, match=r"^model.path is required by model=hf \(dtype auto, max_model_len 0\), got None$"):
        C.ModelConfig(dtype="auto", max_model_len=0)

