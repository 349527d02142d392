"""The external regression table: every published real-engine row stays within its tolerance."""

import sys

import pytest

from conftest import REPO

sys.path.insert(0, str(REPO / "experiments"))
import external  # noqa: E402


@pytest.mark.parametrize("row", external.ROWS, ids=lambda r: r["name"])
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
