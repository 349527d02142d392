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
