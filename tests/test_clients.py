"""Uniform arrivals and multi-client synthetic workloads: counts, ids, seeding and bad entries."""

import numpy as np
import pytest

from cbjax.config import ClientConfig, LengthConfig, WorkloadConfig
from cbjax.app.run import with_overrides
from cbjax.config import RunConfig
from cbjax.workload import build_workload

FIXED = lambda v: LengthConfig(dist="fixed", value=v)  # noqa: E731


def test_uniform_arrivals_are_evenly_spaced_from_one_gap():
    reqs = build_workload(WorkloadConfig(num_requests=4, arrival="uniform", rate=2.0), seed=0)
    assert [r.arrival_s for r in reqs] == [0.5, 1.0, 1.5, 2.0]


def test_clients_send_at_their_rates_until_the_duration():
    cfg = WorkloadConfig(
        arrival="uniform",
        duration_s=10.0,
        clients=[
            ClientConfig(client_id="a", rate=1.5, prompt_len=FIXED(256), output_len=FIXED(256)),
            ClientConfig(client_id="b", rate=3.0, prompt_len=FIXED(256), output_len=FIXED(128)),
        ],
    )
    reqs = build_workload(cfg, seed=0)
    a = [r for r in reqs if r.client_id == "a"]
    b = [r for r in reqs if r.client_id == "b"]
    # a at 2/3, 4/3, ..., 28/3 (the 15th, 10.0, is not before 10); b at 1/3, ..., 29/3
    assert len(a) == 14 and len(b) == 29
    assert np.allclose([r.arrival_s for r in a], np.arange(1, 15) / 1.5)
    assert {r.target_output_len for r in a} == {256} and {r.target_output_len for r in b} == {128}
    assert [r.request_id for r in reqs] == [str(i) for i in range(43)]
    assert [r.arrival_s for r in reqs] == sorted(r.arrival_s for r in reqs)
    # a tie (t = 2/3 for a and b) keeps list order: a first
    tie = [r.client_id for r in reqs if abs(r.arrival_s - 2 / 3) < 1e-12]
    assert tie == ["a", "b"]


def test_clients_num_requests_and_defaults_from_the_workload():
    cfg = WorkloadConfig(
        arrival="all_at_once",
        output_len=FIXED(7),
        clients=[ClientConfig(client_id="x", num_requests=2), ClientConfig(client_id="y", num_requests=3,
                                                                          output_len=FIXED(2))],
    )
    reqs = build_workload(cfg, seed=0)
    assert [(r.client_id, r.target_output_len, r.arrival_s) for r in reqs] == [
        ("x", 7, 0.0), ("x", 7, 0.0), ("y", 2, 0.0), ("y", 2, 0.0), ("y", 2, 0.0)
    ]


def test_poisson_clients_are_seeded_and_independent_of_each_other():
    def build(rate_b, seed=1):
        cfg = WorkloadConfig(arrival="poisson", duration_s=200.0, clients=[
            ClientConfig(client_id="a", rate=2.0), ClientConfig(client_id="b", rate=rate_b)])
        return build_workload(cfg, seed)

    a1 = [(r.arrival_s, r.prompt_len) for r in build(1.0) if r.client_id == "a"]
    assert a1 == [(r.arrival_s, r.prompt_len) for r in build(5.0) if r.client_id == "a"]
    assert a1 != [(r.arrival_s, r.prompt_len) for r in build(1.0, seed=2) if r.client_id == "a"]
    assert 320 < len(a1) < 480  # 400 expected, sd 20
    assert max(t for t, _ in a1) < 200.0


@pytest.mark.parametrize(
    "clients, message",
    [
        ([{"client_id": "a", "rate": 1.0}, {"client_id": "b", "rate": 0}], r"workload.clients\[1\].rate must be > 0, got 0"),
        ([{"client_id": "a"}, {"client_id": "a"}], r"workload.clients\[1\].client_id: duplicate 'a' \(also workload.clients\[0\]\)"),
        ([{"client_id": ""}], r"workload.clients\[0\].client_id must be a non-empty string"),
        ([{"client_id": "a", "rte": 2}], r"workload.clients\[0\]: unknown keys \['rte'\]"),
        ([{"client_id": "a", "arrival": "bursty"}], r"workload.clients\[0\].arrival: unknown value 'bursty'"),
        ([{"client_id": "a", "output_len": {"dist": "fixed", "value": 0}}], r"workload.clients\[0\].output_len.value must be >= 1"),
    ],
)
def test_bad_client_entries_fail_naming_the_entry(clients, message):
    with pytest.raises(ValueError, match=message):
        WorkloadConfig(arrival="uniform", duration_s=5.0, clients=clients)


def test_a_client_needs_a_count_or_a_duration():
    with pytest.raises(ValueError, match=r"workload.clients\[0\]: set num_requests"):
        WorkloadConfig(arrival="poisson", clients=[{"client_id": "a"}])
    with pytest.raises(ValueError, match=r"workload.clients\[0\]: set num_requests"):
        WorkloadConfig(arrival="all_at_once", duration_s=3.0, clients=[{"client_id": "a"}])
    with pytest.raises(ValueError, match="workload.duration_s applies only with workload.clients"):
        WorkloadConfig(duration_s=3.0)


def test_clients_survive_with_overrides():
    cfg = RunConfig(workload=WorkloadConfig(arrival="uniform", duration_s=4.0, clients=[{"client_id": "a", "rate": 1.0}]))
    out = with_overrides(cfg, {"workload.clients": [{"client_id": "a", "rate": 2.0}, {"client_id": "b"}]})
    assert [(c.client_id, c.rate) for c in out.workload.clients] == [("a", 2.0), ("b", 1.0)]
    with pytest.raises(ValueError, match=r"workload.clients\[1\].rate must be > 0"):
        with_overrides(cfg, {"workload.clients": [{"client_id": "a"}, {"client_id": "b", "rate": -1}]})


def test_bad_client_from_the_command_line_names_the_entry():
    from test_cli import composed

    with pytest.raises(ValueError, match=r"workload.clients\[1\].rate must be > 0"):
        composed("workload.arrival=uniform", "workload.duration_s=5",
                 "workload.clients=[{client_id: a, rate: 1.5}, {client_id: b, rate: 0}]")  # fmt: skip
    with pytest.raises(ValueError, match=r"workload.clients\[1\].client_id: duplicate 'a'"):
        composed("workload.arrival=uniform", "workload.duration_s=5",
                 "workload.clients=[{client_id: a, rate: 1.5}, {client_id: a, rate: 2}]")  # fmt: skip
