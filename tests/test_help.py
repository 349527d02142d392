"""The three commands' --help pages: what each says, and that it stays true to the command (every
key it names is in the command's schema, every group it lists composes with the command)."""

import dataclasses
import os
import re
import subprocess
import sys
import typing

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

import cbjax.bench.cli  # noqa: F401  registers BenchConfig
import cbjax.serve.cli  # noqa: F401  registers ServeConfig and serve.yaml's resolver
from cbjax.bench.config import BenchConfig
from cbjax.app.cli import CONFIG_DIR
from cbjax.config import RunConfig
from cbjax.config.help import PAGES, group_options, help_page, root_defaults
from cbjax.app.config_merge import check_known_keys, to_run_config
from cbjax.serve.config import ServeConfig

SCHEMAS = {"cbjax": RunConfig, "cbjax-serve": ServeConfig, "cbjax-bench": BenchConfig}
MODULES = {"cbjax": "cbjax", "cbjax-serve": "cbjax.serve", "cbjax-bench": "cbjax.bench"}
# options composed only with a key they require
NEEDS = {("workload", "trace"): ["workload.path=x.csv"], ("model", "hf"): ["model.path=x"]}
FILE_SUFFIXES = ("md", "json", "jsonl", "yaml", "log")


def schema_has(cls: type, key: str) -> bool:
    """Whether the dotted `key` is a field path of the dataclass `cls`."""
    for part in key.split("."):
        if not dataclasses.is_dataclass(cls):
            return False
        hints = typing.get_type_hints(cls)
        if part not in hints:
            return False
        cls = hints[part]
        args = [a for a in typing.get_args(cls) if a is not type(None)]
        if typing.get_origin(cls) is typing.Union and len(args) == 1:
            cls = args[0]  # Optional[X]
    return True


def composed(command: str, *overrides: str):
    """The command's typed, checked config for `overrides`, as its CLI builds it."""
    root = PAGES[command].root
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        cfg = compose(config_name=root, overrides=list(overrides))
    if command == "cbjax":
        return to_run_config(cfg)
    check_known_keys(cfg, SCHEMAS[command])
    return OmegaConf.to_object(cfg)


@pytest.mark.parametrize("command", sorted(PAGES))
def test_help_says_what_the_command_does_with_its_own_groups_only(command, env_cpu):
    proc = subprocess.run([sys.executable, "-m", MODULES[command], "--help"], env=env_cpu, capture_output=True,
                          text=True, timeout=120)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    page = proc.stdout
    assert page.startswith(f"{command} ") and "powered by Hydra" not in page
    assert "docs/" in page and f"{command} --hydra-help" in page
    listed = set(re.findall(r"^([a-z_]+): ", page, flags=re.M))
    assert listed == {g.name for g in PAGES[command].groups if g.name}
    others = {"cbjax": {"server", "bench"}, "cbjax-serve": {"bench", "experiment", "hparams_search", "workload"},
              "cbjax-bench": {"server", "scheduler", "executor", "model", "experiment"}}[command]  # fmt: skip
    assert not listed & others
    for group in PAGES[command].groups:
        for key, meaning in group.keys:
            assert re.search(rf"^  {re.escape(key)} +{re.escape(meaning)}$", page, flags=re.M), key


@pytest.mark.parametrize("command", sorted(PAGES))
def test_every_key_the_help_names_is_in_the_commands_schema(command):
    schema = SCHEMAS[command]
    page = PAGES[command]
    for group in page.groups:
        for key, _ in group.keys:
            assert schema_has(schema, key), f"{command} --help names {key}, which {schema.__name__} lacks"
    text = help_page(command)
    dotted = set(re.findall(r"(?<![\w./-])[a-z_]+(?:\.[a-z_]+)+\b", text))
    keys = {d for d in dotted if d.rsplit(".", 1)[1] not in FILE_SUFFIXES}
    assert keys, "the page names no dotted key"
    missing = sorted(k for k in keys if not schema_has(schema, k))
    assert not missing, f"{command} --help names keys {schema.__name__} lacks: {missing}"
    assert not schema_has(schema, "scheduler.max_num_seq")  # the check can fail


@pytest.mark.parametrize("command", sorted(PAGES))
def test_every_group_the_help_lists_composes_with_the_command(command):
    defaults = root_defaults(CONFIG_DIR / f"{PAGES[command].root}.yaml")
    for group in PAGES[command].groups:
        if group.name is None:
            continue
        options = group_options(CONFIG_DIR, group.name)
        assert options, group.name
        # one option other than the root's choice: selecting it needs the group in the defaults list
        option = next((o for o in options if o != defaults.get(group.name)), options[0])
        composed(command, f"{group.name}={option}", *NEEDS.get((group.name, option), []))


def test_a_group_the_command_lacks_fails_to_compose():
    with pytest.raises(Exception, match="server"):
        composed("cbjax", "server=default")
    with pytest.raises(Exception, match="scheduler"):
        composed("cbjax-bench", "scheduler=sjf")


@pytest.mark.parametrize("prog", sorted(MODULES))
def test_help_into_a_closed_pipe_ends_without_a_traceback(prog, env_cpu):
    """`cbjax --help | head -2`: the reader leaves before the page is written."""
    read, write = os.pipe()
    os.close(read)  # every write to the pipe now fails (EPIPE)
    try:
        proc = subprocess.run([sys.executable, "-m", MODULES[prog], "--help"], stdout=write, stderr=subprocess.PIPE,
                              env=env_cpu, text=True, timeout=120)  # fmt: skip
    finally:
        os.close(write)
    assert proc.returncode == 1 and proc.stderr == "", proc.stderr[-2000:]
