"""`cbjax.profile.copies`: the host tier's copy terms fitted on copies timed while serving, by hand."""

import pytest

from cbjax.profile.copies import MIN_SERVED_COPIES, fit_served_copies


def rows(store_fixed, store_page, load_fixed, load_page, n=MIN_SERVED_COPIES):
    """Copies priced as the profiled model prices them: each direction's fixed cost once a step
    copies that way, plus its cost per page."""
    out = []
    for i in range(n):
        stores, loads = 1 + i % 4, (2 + i % 5) if i % 3 else 0  # some steps store only
        t = (store_fixed + store_page * stores if stores else 0.0) + (load_fixed + load_page * loads if loads else 0.0)
        out.append({"stores": stores, "loads": loads, "measured_s": t})
    out += [{"stores": 0, "loads": 1 + i % 6, "measured_s": load_fixed + load_page * (1 + i % 6)} for i in range(n)]
    return out


def test_each_direction_s_terms_come_back_from_served_copies():
    fitted = fit_served_copies(rows(2e-4, 1e-5, 5e-4, 4e-5))
    assert fitted["swap_out_iter_s"] == pytest.approx(2e-4, rel=1e-6)
    assert fitted["swap_out_page_s"] == pytest.approx(1e-5, rel=1e-6)
    assert fitted["swap_in_iter_s"] == pytest.approx(5e-4, rel=1e-6)
    assert fitted["swap_in_page_s"] == pytest.approx(4e-5, rel=1e-6)


def test_too_few_served_copies_of_a_direction_keep_the_copies_timed_alone():
    # fewer steps that load than the fit needs: nothing replaces the terms timed alone
    few = [r for r in rows(2e-4, 1e-5, 5e-4, 4e-5) if not r["loads"]]
    assert fit_served_copies(few) == {}
    assert fit_served_copies([]) == {}
