"""The overhead group: a serving stack's host costs, apart from the hardware's datasheet figures."""

import dataclasses

import pytest
import yaml
from hydra.errors import ConfigCompositionException

from conftest import REPO, make_plan
from cbjax import config as C
from cbjax.config.overhead import load_overhead
from cbjax.app.config_merge import merge_overrides
from cbjax.sim import make_cost_model
from test_config_schema import composed
from test_cost_model import HW, MODEL, req

CONFIGS = REPO / "configs"


def test_the_default_is_none_and_charges_nothing():
    cfg = composed()
    assert cfg.overhead == C.OverheadConfig() and cfg.overhead.name == "none" and cfg.overhead.is_none
    plan = make_plan(num_slots=2, decodes=[req(3, 1)])
    bare = make_cost_model("roofline", MODEL, HW)
    assert make_cost_model("roofline", MODEL, HW, overhead=cfg.overhead)(plan).total_s == bare(plan).total_s
    # 360 B of weights + 80 B of K/V over 50 B/s (test_roofline_decode_is_memory_bound_by_hand)
    assert bare(plan).total_s == pytest.approx(440 / 50)


def test_each_stack_composes_with_its_values_and_provenance():
    vllm = composed("overhead=vllm_0_1").overhead
    assert (vllm.name, vllm.step_s, vllm.seq_s, vllm.page_s, vllm.copy_latency_s) == ("vllm_0_1", 0.004, 0.0004, 1e-6, 5e-6)
    hf = composed("overhead=hf_generate").overhead
    assert (hf.name, hf.step_s, hf.seq_s, hf.page_s, hf.copy_latency_s) == ("hf_generate", 0.085, 0.0, 0.0, 0.0)
    for path in sorted((CONFIGS / "overhead").glob("*.yaml")):
        stack = composed(f"overhead={path.stem}").overhead
        assert stack.name == path.stem
        if not stack.is_none:
            assert stack.fitted_on and stack.source, f"{path.name} must say what it was fitted on and its source"


def test_a_misspelled_key_or_stack_fails_naming_it():
    with pytest.raises(ValueError, match=r"unknown key overhead\.step; did you mean overhead\.step_s"):
        composed("+overhead.step=1")
    with pytest.raises(ConfigCompositionException, match="overhead"):
        composed("overhead=vllm_0_2")
    with pytest.raises(ValueError, match="overhead.seq_s must be >= 0"):
        C.OverheadConfig(seq_s=-1.0)
    with pytest.raises(ValueError, match=r"arm: overhead: unknown overhead 'vllm'; choose one of .*vllm_0_1"):
        merge_overrides(composed(), {"overhead": "vllm"}, where="arm")


def test_an_arm_selects_a_whole_stack_by_name():
    base = composed("overhead=vllm_0_1")
    # selecting hf_generate replaces every field, not only the ones hf_generate's file sets
    hf = merge_overrides(base, {"overhead": "hf_generate"}).overhead
    assert hf == composed("overhead=hf_generate").overhead and hf.seq_s == 0.0 and hf.page_s == 0.0
    assert merge_overrides(base, {"overhead": "none"}).overhead == C.OverheadConfig()
    # a field can still be patched on its own
    assert merge_overrides(base, {"overhead.step_s": 0.01}).overhead == dataclasses.replace(base.overhead, step_s=0.01)
    assert load_overhead("step_2ms")["step_s"] == 0.002


def test_hardware_holds_only_datasheet_figures():
    stack_like = [f.name for f in dataclasses.fields(C.HardwareConfig) if "overhead" in f.name or "latency" in f.name]
    assert stack_like == []
    for path in sorted((CONFIGS / "hardware").glob("*.yaml")):
        raw = yaml.safe_load(path.read_text()) or {}
        assert not set(raw) & {f.name for f in dataclasses.fields(C.OverheadConfig)} - {"name"}, path.name


REPRODUCTIONS = [p for p in sorted((CONFIGS / "experiment").glob("*.yaml"))
                 if (yaml.safe_load(p.read_text()).get("experiment") or {}).get("reproduction")]  # fmt: skip


@pytest.mark.parametrize("path", REPRODUCTIONS, ids=lambda p: p.stem)
def test_every_reproduction_names_its_overhead(path):
    defaults = yaml.safe_load(path.read_text()).get("defaults", [])
    named = [d["override /overhead"] for d in defaults if isinstance(d, dict) and "override /overhead" in d]
    assert len(named) == 1 and (CONFIGS / "overhead" / f"{named[0]}.yaml").is_file(), path.name


def test_the_stack_costs_add_to_the_roofline_by_hand():
    stack = C.OverheadConfig(step_s=0.25, seq_s=0.5, page_s=0.125, copy_latency_s=0.5)
    plan = make_plan(num_slots=4, decodes=[req(3, 1), req(7, 1)], prefills=[req(0, 5)], page_size=4)
    plan.swap_out = [(req(8, 0), [1, 2])]
    bare = make_cost_model("roofline", MODEL, HW)(plan).total_s
    # 0.25 a step; 3 sequences x 0.5; pages read ceil(4/4) + ceil(8/4) + ceil(5/4) = 5 x 0.125;
    # 2 swapped pages x 1 layer x (K, V) = 4 copy calls x 0.5
    got = make_cost_model("roofline", MODEL, HW, overhead=stack)(plan).total_s
    assert got == pytest.approx(bare + 0.25 + 3 * 0.5 + 5 * 0.125 + 4 * 0.5)


def test_a_stack_adds_to_the_profiled_model_only_when_selected(tmp_path):
    from test_profiled import MODEL as TINY
    from test_profiled import configs, decode_and_prefill, write_profile

    path = write_profile(tmp_path / "p.json", page_size=4, num_slots=4)
    d, p = decode_and_prefill()
    plan = make_plan(num_slots=4, decodes=[d], prefills=[p], page_size=4)
    measured = make_cost_model("profiled", TINY, None, **configs(path))
    # none: the profile alone (its steps hold the engine's own host time)
    assert make_cost_model("profiled", TINY, None, **configs(path), overhead=C.OverheadConfig())(plan).total_s == measured(plan).total_s
    stack = C.OverheadConfig(step_s=0.5, seq_s=0.25, page_s=0.125)
    # 0.5 a step, 2 sequences x 0.25; pages read: the decode at position 4 ceil(5/4) = 2, the
    # 40-token prefill ceil(40/4) = 10: 12 x 0.125
    got = make_cost_model("profiled", TINY, None, **configs(path), overhead=stack)(plan).total_s
    assert got == pytest.approx(measured(plan).total_s + 0.5 + 2 * 0.25 + 12 * 0.125)
