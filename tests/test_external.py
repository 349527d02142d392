"""The external regression table: every published real-engine row stays within its tolerance."""

import sys

import pytest

from conftest import REPO

sys.path.insert(0, str(REPO / "experiments"))
import external  # noqa: E402


@pytest.mark.parametrize("row", [r for r in external.ROWS if not r.get("off")], ids=lambda r: r["name"])
def test_every_external_row_is_within_its_tolerance(row):
    got = external.evaluate_row(row)
    assert abs(got["ours"] - row["published"]) <= row["tolerance"] * row["published"], (
        f"{row['name']}: simulator {got['ours']:.4g} vs published {row['published']:g} "
        f"({got['error']:+.1%}, tolerance ±{row['tolerance']:.0%})"
    )
    assert got["verdict"] == "pass"
    assert "github.com" in row["source"]  # every row cites where its figure was published


def test_rows_name_their_stack():
    from cbjax.app.run import with_overrides

    anyscale = next(r for r in external.ROWS if r.get("experiment") == "anyscale_output_cap")
    cfg = external._compose([], anyscale["experiment"])
    vllm = with_overrides(cfg, cfg.experiment.arms[anyscale["arm"]])
    naive = with_overrides(cfg, cfg.experiment.arms[anyscale["ratio_to"]])
    assert (vllm.overhead.name, naive.overhead.name) == ("vllm_0_1", "hf_generate")
    assert anyscale["tolerance"] == 0.15 and anyscale["fitted"]
    modern = [r for r in external.ROWS if "overhead=none" in r.get("overrides", [])]
    assert modern and all(r["tolerance"] == 0.25 and not r["fitted"] for r in modern)


def test_held_out_rows_span_three_accelerators_each_with_its_hardware_file():
    from cbjax.app.run import resolve

    held = [r for r in external.ROWS if not r["fitted"]]
    hardware = {o.split("=", 1)[1] for r in held for o in r["overrides"] if o.startswith("hardware=")}
    assert hardware == {"a100_80gb", "h100_sxm", "l40s"}
    l40s = resolve(external._compose(next(r for r in held if "hardware=l40s" in r["overrides"])["overrides"]))
    assert (l40s.hardware.peak_flops, l40s.hardware.mem_bw, l40s.hardware.mem_bytes) == (362.05e12, 864e9, 48e9)
    assert l40s.scheduler.max_num_batched_tokens == 2048 and l40s.workload.num_requests == 2000


def test_open_rows_compose_and_are_shown_apart_from_the_held_out_count():
    from cbjax.app.run import resolve

    for row in external.OPEN_ROWS:  # each setup is a valid run config, without running it
        cfg = resolve(external._compose(row["overrides"]))
        assert (cfg.cache.allocation, cfg.overhead.name, cfg.model.name) == ("reserve_oracle", "none", "llama3_8b")
        assert cfg.workload.num_requests == external.TRT_LLM_013_REQUESTS[
            (cfg.workload.prompt_len.value, cfg.workload.output_len.value)]
    held = {**external.ROWS[1], "ours": 1.0, "error": 0.0, "verdict": "pass"}
    shown = {**external.OPEN_ROWS[0], "ours": 2.0 * external.OPEN_ROWS[0]["published"], "error": 1.0, "verdict": "fail"}
    page = external.render([held], [shown])
    assert "Held out: 1 of 1 rows within tolerance" in page
    assert "## Rows whose setup the source leaves open" in page and "+100.0%" in page
    assert "leaves open" not in external.render([held])


def test_rows_outside_tolerance_and_measured_rates_are_shown():
    off = [r for r in external.ROWS if r.get("off")]
    assert off and all(not r["fitted"] for r in off)  # only held-out rows may be off, each in the table
    inside = {**external.ROWS[1], "ours": 1.0, "error": 0.0, "verdict": "pass"}
    outside = {**off[0], "ours": 1.4 * off[0]["published"], "error": 0.4, "verdict": "fail"}
    at_rates = {**outside, "ours": 1.6 * off[0]["published"], "error": 0.6}
    page = external.render([inside, outside], at_measured=[(outside, at_rates)])
    assert "Held out: 1 of 2 rows within tolerance" in page
    assert "| fail " in page and "+40.0%" in page and "+60.0%" in page
    assert "Within tolerance at measured rates: 0 of 1." in page
    # the measured rates are set as overrides of the row's own hardware, from a cited source
    row = next(r for r in external.ROWS if "hardware=h100_sxm" in r.get("overrides", []))
    rates = external.MEASURED_RATES["h100_sxm"]
    assert external.measured(row)["overrides"][-2:] == [
        f"hardware.bw_efficiency={rates['bw_efficiency']}", f"hardware.flops_efficiency={rates['flops_efficiency']}"]
    assert all("github.com" in r["bw_source"] + r["flops_source"] for r in external.MEASURED_RATES.values())
    assert external.measured(external.ROWS[0]) is None  # an experiment's row keeps its own stack
