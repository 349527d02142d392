"""What a run gets when it names no model, hardware or prefix caching: the simulator models
Llama-3-8B on an H100 with a KV pool sized as vLLM sizes it, the engine runs the tiny model,
prefix caching is on, and a choice made on the command line or by an experiment wins."""

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

import cbjax.profile.__main__  # noqa: F401  registers the profile's schema
import cbjax.serve.cli  # noqa: F401  registers the server's schema and serve.yaml's resolver
from cbjax.app.cli import CONFIG_DIR, to_run_config
from cbjax.app.run import run_single
from cbjax.config import RunConfig
from cbjax.config.help import help_page

# Llama-3-8B's bf16 weights (8.03e9 parameters x 2 bytes) read once per decode step at an
# H100's 3.35 TB/s: no simulated decode step of the default run can be shorter.
LLAMA3_8B_DECODE_FLOOR_S = 8.03e9 * 2 / 3.35e12


def composed(*overrides: str, root: str = "config"):
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        cfg = compose(config_name=root, overrides=list(overrides))
    return to_run_config(cfg) if root == "config" else OmegaConf.to_object(cfg)


def machine(cfg) -> tuple:
    return cfg.executor.name, cfg.model.name, cfg.hardware.name, cfg.cache.num_pages


def test_each_executor_has_its_own_default_model_and_hardware():
    assert machine(composed()) == ("sim", "llama3_8b", "h100_sxm", "auto")
    assert composed().model.d_model == 4096  # configs/model/llama3_8b.yaml's shape, not a name alone
    assert machine(composed("executor=jax")) == ("jax", "tiny", "a100_80gb", 4096)


def test_a_default_simulator_run_has_a_real_models_latencies_and_rejects_nothing(tmp_path):
    summary = run_single(composed("progress=false"), tmp_path, verbose=False)
    assert (summary["model"], summary["hardware"]) == ("llama3_8b", "h100_sxm")
    assert summary["num_rejected"] == 0 and summary["num_finished"] == summary["num_requests"] == 256
    # 90% of 80 GB less 16 GB of weights, in pages of 16 tokens x 128 KiB: about 26,700
    assert 26_000 < summary["num_pages"] < 27_500
    assert summary["tpot_s_p50"] >= LLAMA3_8B_DECODE_FLOOR_S
    assert summary["ttft_s_p50"] > summary["tpot_s_p50"]


def test_an_explicit_model_hardware_or_pool_wins():
    # a chosen model leaves the default's pool sizing behind: the pool is the one set, or 4096
    assert machine(composed("model=llama2_7b")) == ("sim", "llama2_7b", "h100_sxm", 4096)
    assert machine(composed("hardware=a100_40gb")) == ("sim", "llama3_8b", "a100_40gb", "auto")
    assert machine(composed("cache.num_pages=1000")) == ("sim", "llama3_8b", "h100_sxm", 1000)
    assert machine(composed("model=tiny", "hardware=a100_80gb")) == ("sim", "tiny", "a100_80gb", 4096)
    assert machine(composed("executor=jax", "model=llama3_8b", "hardware=h100_sxm")) == (
        "jax", "llama3_8b", "h100_sxm", 4096,
    )  # fmt: skip
    assert machine(composed("experiment=vtc_overload")) == ("sim", "llama2_7b", "a10g", 626)


def test_prefix_caching_is_on_by_default_and_shares_a_common_prefix(tmp_path):
    assert RunConfig().cache.prefix_caching is True
    assert composed().cache.prefix_caching and composed("executor=jax").cache.prefix_caching
    workload = ("progress=false", "workload=shared_prefix", "workload.num_requests=40")
    on = run_single(composed(*workload), tmp_path / "on", verbose=False)
    off = run_single(composed(*workload, "cache.prefix_caching=false"), tmp_path / "off", verbose=False)
    assert on["prefix_cache_hit_rate"] > 0.5 and off["prefix_cache_hit_rate"] == 0.0


def test_a_reservation_asks_for_prefix_caching_off():
    with pytest.raises(ValueError, match=r"cache\.allocation=reserve_max .*set cache\.prefix_caching=false"):
        composed("cache.allocation=reserve_max")
    assert composed("cache.allocation=reserve_max", "cache.prefix_caching=false").cache.allocation == "reserve_max"


def test_the_server_follows_cbjax_and_the_profile_times_the_tiny_engine():
    assert machine(composed(root="serve")) == ("sim", "llama3_8b", "h100_sxm", "auto")
    assert machine(composed("executor=jax", root="serve")) == ("jax", "tiny", "a100_80gb", 4096)
    assert machine(composed("model=tiny", root="serve"))[1:3] == ("tiny", "h100_sxm")
    assert machine(composed(root="profile")) == ("jax", "tiny", "a100_80gb", 4096)


def test_help_stars_each_executors_default():
    for command in ("cbjax", "cbjax-serve"):
        page = " ".join(help_page(command).split())  # a wrapped line joined again
        assert "llama3_8b* (executor=sim)" in page and "tiny* (executor=jax)" in page
        assert "h100_sxm* (executor=sim)" in page and "a100_80gb* (executor=jax)" in page
