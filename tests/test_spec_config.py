"""The spec group and the speculation-length policies: bad values name their key, each policy
picks the k it should, plug-ins load, and a run's outputs carry the speculation fields only when
it speculates."""

from __future__ import annotations

import dataclasses
import json
import textwrap

import pytest
from hydra import compose, initialize_config_dir

from conftest import REPO, make_requests
import cbjax.app.cli  # noqa: F401  registers the RunConfig schema with Hydra
from cbjax.app.config_merge import to_run_config
from cbjax.app.run import run_single
from cbjax.config import ModelConfig, RunConfig, SpecConfig, WorkloadConfig
from cbjax.core.request import Request
from cbjax.core.results import LoadCounts
from cbjax.report.tables import format_summary
from cbjax.spec.policy import BatchSizePolicy, FixedPolicy, GoodputPolicy, SpecPolicy, SpecView, make_spec_policy


def composed(*overrides):
    with initialize_config_dir(config_dir=str(REPO / "configs"), version_base="1.3"):
        return to_run_config(compose(config_name="config", overrides=list(overrides)))


@pytest.mark.parametrize("kwargs,match", [
    ({"num_tokens": -1}, r"spec\.num_tokens must be an int >= 1, got -1"),
    ({"method": "foo"}, r"spec\.method: unknown value 'foo'; choose one of none, ngram, draft"),
    ({"method": "ngram", "policy": "batch_size", "policy_args": {"table": {"1-16": 3, "10-20": 1}}},
     r"spec\.policy_args\.table has overlapping ranges"),
    ({"method": "ngram", "policy": "batch_size", "policy_args": {"table": {"16-1": 3}}},
     r"spec\.policy_args\.table has a bad range '16-1'"),
    ({"method": "ngram", "policy": "batch_size", "policy_args": {"table": {"1-16": 9}}},
     r"spec\.policy_args\.table maps '1-16' to 9; drafts must be an int in \[0, spec\.num_tokens=3\]"),
    ({"method": "ngram", "acceptance": "trace"}, r"spec\.acceptance_path is required by spec\.acceptance=trace"),
    ({"method": "ngram", "acceptance": "per_position"}, r"spec\.acceptance_rates must list a rate"),
    ({"method": "ngram", "acceptance_rates": [0.5, 1.5]}, r"spec\.acceptance_rates must hold rates in \[0, 1\]"),
    ({"acceptance_rate": 1.2}, r"spec\.acceptance_rate must be in \[0, 1\]"),
    ({"method": "draft"}, r"spec\.draft_model or spec\.draft_layers: set exactly one"),
    ({"method": "ngram", "draft_layers": 2}, r"spec\.draft_layers applies only with spec\.method=draft"),
    ({"ngram_min": 3, "ngram_max": 2}, r"spec\.ngram_max must be >= spec\.ngram_min \(3\)"),
    ({"policy": "nope"}, r"spec\.policy: unknown value 'nope'"),
    ({"policy": "my mod:Cls"}, r"spec\.policy must be fixed, batch_size, goodput or look like"),
])  # fmt: skip
def test_a_bad_spec_value_is_an_error_naming_its_key(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SpecConfig(**kwargs)


def test_the_draft_must_fit_the_target_model():
    tiny = ModelConfig()  # 2 layers, vocabulary 512
    with pytest.raises(ValueError, match=r"spec\.draft_layers must be below model\.num_layers \(2\), got 2"):
        RunConfig(model=tiny, spec=SpecConfig(method="draft", draft_layers=2))
    with pytest.raises(ValueError, match=r"spec\.draft_model has vocab_size 49152, the target model 'tiny' has 512"):
        RunConfig(model=tiny, spec=SpecConfig(method="draft", draft_model="smollm_135m"))
    with pytest.raises(ValueError, match=r"spec\.draft_model: unknown model 'gpt9'"):
        RunConfig(model=tiny, spec=SpecConfig(method="draft", draft_model="gpt9"))
    RunConfig(model=tiny, spec=SpecConfig(method="draft", draft_layers=1))
    same_vocab = dataclasses.replace(tiny, vocab_size=49152)
    RunConfig(model=same_vocab, spec=SpecConfig(method="draft", draft_model="smollm_135m"))


def test_the_group_composes_and_a_command_line_key_fails_naming_it():
    assert composed().spec == SpecConfig()
    assert composed("spec=ngram").spec.method == "ngram"
    cfg = composed("spec=ngram", "spec.num_tokens=5", "spec.policy=batch_size", "+spec.policy_args.table={1-8:5,9-64:2}")
    assert cfg.spec.num_tokens == 5 and make_spec_policy(cfg.spec).table == [(1, 8, 5), (9, 64, 2)]
    with pytest.raises(Exception, match=r"spec\.num_tokens must be an int >= 1"):
        composed("spec.num_tokens=0")


def decoding(rid, room=100):
    """A request admitted and decoding, with room for `room` more drafts."""
    req = Request(rid, 0.0, 4)
    req.max_output_len = room + 1
    return req


def view(num_decodes, step_s=None, max_drafts=5):
    reqs = [decoding(str(i)) for i in range(num_decodes)]
    return SpecView(reqs, num_decodes, 0, max_drafts, None, step_s)


def test_fixed_and_batch_size_choose_what_their_config_says():
    spec = SpecConfig(method="ngram", num_tokens=5)
    assert FixedPolicy(spec).num_drafts(view(100)) == 5
    table = BatchSizePolicy(spec, table={"1-2": 5, "3-4": 1, "9-10": 2})
    assert [table.num_drafts(view(n)) for n in (1, 2, 3, 4, 5, 8, 9, 10, 11)] == [5, 5, 1, 1, 0, 0, 2, 2, 0]
    # no table: 3 drafts up to 16 decodes, 1 up to 64, then none (each at most num_tokens)
    default = BatchSizePolicy(SpecConfig(method="ngram", num_tokens=2))
    assert [default.num_drafts(view(n)) for n in (1, 16, 17, 64, 65)] == [2, 2, 1, 1, 0]


def test_goodput_picks_the_k_of_most_expected_tokens_per_second():
    # acceptance 0.8 (the prior, nothing seen yet), a step costs 1 + 0.2 k seconds. Tokens per
    # second per decode, (1 - 0.8^(k+1)) / 0.2 / (1 + 0.2 k): k=0 1.000, 1 1.500, 2 1.743,
    # 3 1.845, 4 1.868, 5 1.845: k = 4
    policy = GoodputPolicy(SpecConfig(method="ngram", num_tokens=5), prior=0.8)
    assert policy.num_drafts(view(3, lambda k: 1 + 0.2 * k)) == 4
    # a step twice as dear per draft: 0 1.000, 1 1.286, 2 1.356, 3 1.342: k = 2
    assert policy.num_drafts(view(3, lambda k: 1 + 0.4 * k)) == 2
    # what it sees moves the estimate: 40 drafts tried, none accepted -> (0 + 10 x 0.8) / 50 = 0.16,
    # 0 1.000, 1 1.160 / 1.2 = 0.967: k = 0
    req = Request("x", 0.0, 4)
    for _ in range(40):
        policy.on_verified(req, 3, 0)
    assert policy.rate() == pytest.approx(0.16)
    assert policy.num_drafts(view(3, lambda k: 1 + 0.2 * k)) == 0
    with pytest.raises(ValueError, match=r"spec\.policy=goodput needs a cost model"):
        policy.num_drafts(view(3, None))


def test_goodput_counts_only_the_drafts_each_decodes_length_leaves_it():
    # acceptance 0.5 (the prior); decode "room" may take every draft, decode "last" is at its
    # last token and verifies none whatever k is (its step yields 1 token). A step costs
    # 1 + 0.3 k seconds. Tokens per second, (E(k) + 1) / (1 + 0.3 k) with E(k) = 2 - 0.5^k:
    # k=0 2 / 1 = 2.000, 1 2.5 / 1.3 = 1.923, 2 2.75 / 1.6 = 1.719: k = 0. (Counting E(k) for
    # "last" too would give k=1 3 / 1.3 = 2.308 over k=0's 2.)
    room, last = decoding("room"), decoding("last", room=0)
    policy = GoodputPolicy(SpecConfig(method="ngram", num_tokens=3), prior=0.5)
    assert policy.num_drafts(SpecView([room, last], 2, 0, 3, None, lambda k: 1 + 0.3 * k)) == 0
    # "near" has room for one draft, yielding E(min(k, 1)); a step costs 1 + 0.1 k seconds:
    # k=0 2 / 1 = 2.000, 1 (1.5 + 1.5) / 1.1 = 2.727, 2 (1.75 + 1.5) / 1.2 = 2.708,
    # 3 (1.875 + 1.5) / 1.3 = 2.596: k = 1 (E(k) for both would pick k=2, 3.5 / 1.2 = 2.917)
    near = decoding("near", room=1)
    assert policy.num_drafts(SpecView([room, near], 2, 0, 3, None, lambda k: 1 + 0.1 * k)) == 1


def test_goodput_per_request_weighs_each_requests_own_acceptance():
    policy = GoodputPolicy(SpecConfig(method="ngram", num_tokens=5), prior=0.8, prior_weight=1.0, per_request=True)
    good, bad = decoding("good"), decoding("bad")
    for _ in range(50):
        policy.on_verified(good, 4, 4)
        policy.on_verified(bad, 4, 0)
    v = SpecView([good], 1, 0, 5, None, lambda k: 1 + 0.2 * k)
    assert policy.num_drafts(v) == 5
    v = SpecView([bad], 1, 0, 5, None, lambda k: 1 + 0.2 * k)
    assert policy.num_drafts(v) == 0


def test_a_plugin_policy_loads_with_its_args_and_bad_args_name_the_field(tmp_path, monkeypatch):
    (tmp_path / "my_spec_policy.py").write_text(textwrap.dedent("""
        from cbjax.spec.policy import SpecPolicy

        class Halves(SpecPolicy):
            def __init__(self, spec, above: int = 8):
                super().__init__(spec)
                self.above = above

            def num_drafts(self, view):
                return view.max_drafts // 2 if view.num_decodes > self.above else view.max_drafts

        class NotAPolicy:
            pass
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    spec = SpecConfig(method="ngram", num_tokens=4, policy="my_spec_policy:Halves", policy_args={"above": 2})
    policy = make_spec_policy(spec)
    assert isinstance(policy, SpecPolicy) and [policy.num_drafts(view(n, max_drafts=4)) for n in (2, 3)] == [4, 2]
    with pytest.raises(ValueError, match=r"spec\.policy_args\.above: Halves expects int, got 'many'"):
        make_spec_policy(dataclasses.replace(spec, policy_args={"above": "many"}))
    with pytest.raises(ValueError, match=r"spec\.policy_args: Halves does not accept"):
        make_spec_policy(dataclasses.replace(spec, policy_args={"below": 1}))
    with pytest.raises(ValueError, match=r"spec\.policy: 'my_spec_policy:NotAPolicy' is not a subclass"):
        make_spec_policy(dataclasses.replace(spec, policy="my_spec_policy:NotAPolicy", policy_args={}))
    with pytest.raises(ValueError, match=r"spec\.policy_args: FixedPolicy does not accept"):
        make_spec_policy(SpecConfig(method="ngram", policy_args={"k": 2}))


def small_run(spec, tmp_path):
    cfg = RunConfig(progress=False, spec=spec, workload=WorkloadConfig(num_requests=20))
    return run_single(cfg, tmp_path, verbose=False)


def test_a_speculating_run_writes_its_trace_rows_and_summary_fields(tmp_path):
    off = small_run(SpecConfig(), tmp_path / "off")
    assert not (tmp_path / "off" / "spec_trace.jsonl").exists()
    assert "spec_acceptance_rate" not in off and "tokens_per_iteration" not in off
    assert "spec_proposed" not in json.loads((tmp_path / "off" / "requests.jsonl").read_text().splitlines()[0])
    assert "drafts accepted" not in format_summary(off)

    on = small_run(SpecConfig(method="ngram", num_tokens=3, acceptance_rate=0.5), tmp_path / "on")
    rows = [json.loads(line) for line in (tmp_path / "on" / "requests.jsonl").read_text().splitlines()]
    trace = [json.loads(line) for line in (tmp_path / "on" / "spec_trace.jsonl").read_text().splitlines()]
    assert len(rows) == 20 and all("spec_proposed" in r and "spec_accepted" in r for r in rows)
    by_id = {t["request_id"]: t for t in trace}
    for r in rows:
        t = by_id.get(r["request_id"], {"proposed": [], "accepted": []})
        assert (sum(t["proposed"]), sum(t["accepted"])) == (r["spec_proposed"], r["spec_accepted"])
    proposed, accepted = sum(r["spec_proposed"] for r in rows), sum(r["spec_accepted"] for r in rows)
    verifications = sum(1 for t in trace for p in t["proposed"] if p)
    assert on["spec_proposed_tokens"] == proposed and on["spec_accepted_tokens"] == accepted
    assert on["spec_acceptance_rate"] == pytest.approx(accepted / proposed)
    assert on["spec_mean_accepted_per_step"] == pytest.approx((accepted + verifications) / verifications)
    assert on["tokens_per_iteration"] == pytest.approx(on["output_tokens"] / on["iterations"])
    assert on["iterations"] < off["iterations"] and on["output_tokens"] == off["output_tokens"]
    assert "drafts accepted / proposed" in format_summary(on)


def test_metrics_count_drafts_of_ended_requests():
    from cbjax.serve.metrics import ServerMetrics

    class Engine:
        def counts(self):
            return LoadCounts(0, 0, 0, 10, 0)

    metrics = ServerMetrics(Engine(), "m")
    [req] = make_requests([5])
    req.spec_proposed, req.spec_accepted = 12, 7
    metrics.on_finish(req)
    text = metrics.render().decode()
    assert 'cbjax:spec_draft_tokens_total{model_name="m"} 12.0' in text
    assert 'cbjax:spec_accepted_tokens_total{model_name="m"} 7.0' in text


def test_a_draft_model_yaml_naming_a_checkpoint_is_refused(tmp_path):
    """A draft's weights are its seeded random ones: a YAML naming a checkpoint would run with
    random drafts (an acceptance rate near zero), silently."""
    from cbjax.config.spec import load_draft_model

    path = tmp_path / "draft.yaml"
    path.write_text("name: my_draft\nvocab_size: 256\nd_model: 32\nnum_layers: 1\nnum_heads: 2\nnum_kv_heads: 1\n"
                    "ffn_dim: 64\npath: /some/checkpoint\n")  # fmt: skip
    with pytest.raises(ValueError, match=r"^spec.draft_model: .*draft.yaml sets path"):
        load_draft_model(str(path))
    path.write_text(path.read_text().replace("path: /some/checkpoint\n", ""))
    assert load_draft_model(str(path)).name == "my_draft"
