"""Plug-in policies: scheduler.policy_class loads a user's Policy subclass, policy_args its knobs;
every plug-in's arguments are checked against its constructor's annotations."""

import json
import subprocess
from typing import Literal, Optional

import pytest

from conftest import REPO, cbjax_cmd
from test_config_schema import composed
from cbjax.cluster import make_router
from cbjax.core.plugins import check_args
from cbjax.app.run import run_experiment
from cbjax.scheduler.policy import make_policy

WORKLOAD = ["progress=false", "executor.cost_model=unit", "scheduler.max_num_seqs=8", "workload.num_requests=40",
            "workload.arrival=poisson", "workload.rate=2", "cache.num_pages=200"]  # fmt: skip


def test_an_unchanged_fcfs_subclass_from_outside_the_package_gives_fcfs_iterations(tmp_path, env_cpu):
    plugin = tmp_path / "plugins"
    plugin.mkdir()
    (plugin / "my_policies.py").write_text(
        "from cbjax.scheduler.policy import FCFSPolicy\n\n\nclass MyFCFS(FCFSPolicy):\n    pass\n"
    )
    out = tmp_path / "run"
    proc = subprocess.run(
        cbjax_cmd() + WORKLOAD + ["scheduler.policy_class=my_policies:MyFCFS", f"hydra.run.dir={out}"],
        cwd=plugin, env=env_cpu, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    plugged = json.loads((out / "summary.json").read_text())
    fcfs = run_experiment(composed(*WORKLOAD), tmp_path / "fcfs", verbose=False)
    assert plugged["scheduler"] == "my_policies:MyFCFS" and fcfs["scheduler"] == "fcfs"
    assert plugged["iterations"] == fcfs["iterations"] and plugged["makespan_s"] == fcfs["makespan_s"]
    finish = lambda d: [r["finish_s"] for r in map(json.loads, (d / "requests.jsonl").read_text().splitlines())]  # noqa: E731
    assert finish(out) == finish(tmp_path / "fcfs")
    assert plugged["preemptions"] > 0  # the comparison covers victim choice and requeueing too


def test_the_example_policy_takes_its_knobs_from_policy_args(monkeypatch):
    monkeypatch.syspath_prepend(str(REPO / "experiments"))
    cfg = composed("scheduler.policy_class=example_policy:ShortestPromptFirst",
                   "+scheduler.policy_args.long_prompt=100", "+scheduler.policy_args.penalty=3")  # fmt: skip
    policy = make_policy(cfg.scheduler)
    assert (policy.long_prompt, policy.penalty) == (100, 3)
    from cbjax.core.request import Request

    short, long_ = Request("s", 0.0, 100), Request("l", 0.0, 101)
    assert (policy.rank(short), policy.rank(long_)) == (100, 303)
    with pytest.raises(ValueError, match=r"scheduler\.policy_args: ShortestPromptFirst does not accept \{'pnalty': 3\}"):
        make_policy(composed("scheduler.policy_class=example_policy:ShortestPromptFirst",
                             "+scheduler.policy_args.pnalty=3").scheduler)  # fmt: skip
    with pytest.raises(ValueError, match=r"scheduler\.policy_args: FCFSPolicy does not accept"):
        make_policy(composed("+scheduler.policy_args.x=1").scheduler)


def test_a_bad_policy_class_fails_naming_the_key():
    with pytest.raises(ValueError, match=r"scheduler\.policy_class must look like"):
        composed("scheduler.policy_class=no_colon")
    with pytest.raises(ValueError, match=r"scheduler\.policy_class: cannot import module 'nowhere_xyz'"):
        make_policy(composed("scheduler.policy_class=nowhere_xyz:P").scheduler)
    with pytest.raises(ValueError, match=r"scheduler\.policy_class: 'cbjax.core.request:Request' is not a subclass"):
        make_policy(composed("scheduler.policy_class=cbjax.core.request:Request").scheduler)


def test_plug_in_arguments_of_the_wrong_type_fail_naming_key_type_and_value(monkeypatch):
    monkeypatch.syspath_prepend(str(REPO / "experiments"))
    policy = "scheduler.policy_class=example_policy:ShortestPromptFirst"
    with pytest.raises(ValueError) as err:
        make_policy(composed(policy, "+scheduler.policy_args.long_prompt=abc").scheduler)
    assert str(err.value) == "scheduler.policy_args.long_prompt: ShortestPromptFirst expects int, got 'abc'"
    assert make_policy(composed(policy, "+scheduler.policy_args.penalty=3").scheduler).penalty == 3  # an int is a float
    # routers are checked by the same rule
    cfg = composed("cluster.router=power_of_two", "+cluster.router_args.seed=abc")
    with pytest.raises(ValueError) as err:
        make_router(cfg.cluster.router, cfg.cluster.router_args)
    assert str(err.value) == "cluster.router_args.seed: PowerOfTwo expects int, got 'abc'"
    with pytest.raises(ValueError, match=r"^cluster\.router_args\.max_imbalance: PrefixAffinity expects int, got 1\.5$"):
        make_router("prefix_affinity", {"max_imbalance": 1.5})


class _Knobs:
    def __init__(self, cfg, n: Optional[int] = None, mode: Literal["a", "b"] = "a", flag: bool = False,
                 rate: float = 1.0, names: "list[str]" = (), own: "NoSuchType" = None, free=None):  # noqa: F821
        pass


@pytest.mark.parametrize("args, error", [
    ({"n": None, "mode": "b", "flag": True, "rate": 2, "names": ["x"], "own": {"a": 1}, "free": "anything"}, None),
    ({"n": "3"}, "k.n: _Knobs expects Optional[int], got '3'"),
    ({"mode": "c"}, "k.mode: _Knobs expects Literal['a', 'b'], got 'c'"),
    ({"flag": 1}, "k.flag: _Knobs expects bool, got 1"),
    ({"rate": True}, "k.rate: _Knobs expects float, got True"),
    ({"names": "x"}, "k.names: _Knobs expects list[str], got 'x'"),
    ({"nope": 1}, "k: _Knobs does not accept {'nope': 1}"),
])  # fmt: skip
def test_check_args_follows_the_constructors_annotations(args, error):
    if error is None:
        check_args(_Knobs, args, "k", object())
    else:
        with pytest.raises(ValueError) as err:
            check_args(_Knobs, args, "k", object())
        assert str(err.value).startswith(error)
