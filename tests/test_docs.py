"""The README stays short and its quickstart exact; every relative link in the docs resolves; the
trace guide's examples read as their formats; the docs list what an experiment arm writes."""

import dataclasses
import re

from conftest import REPO
from test_config_schema import composed
from cbjax.config import ExperimentConfig, WorkloadConfig
from cbjax.config.workload import TRACE_FORMATS
from cbjax.app.run import run_experiment
from cbjax.workload.trace import detect_format, load_trace

DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


def test_readme_is_short_and_keeps_the_two_quickstart_commands():
    text = (REPO / "README.md").read_text()
    assert len(text.splitlines()) <= 200
    assert "pip install -e . && cbjax experiment=static_vs_continuous" in text
    assert 'pip install -e ".[test]" && python -m pytest' in text
    assert 'pip install -e ".[test]" && ruff check . && python -m pytest' in (REPO / ".ci" / "run").read_text()


def anchors(path):
    """GitHub's heading anchors of a markdown file (lowercase, punctuation dropped, spaces to -)."""
    found, seen = set(), {}
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)
    for line in text.splitlines():
        m = re.match(r"^#+\s+(.*)", line)
        if m:
            slug = re.sub(r"[^\w\- ]", "", m.group(1).strip().lower()).replace(" ", "-")
            n = seen.get(slug, 0)
            seen[slug] = n + 1
            found.add(slug if n == 0 else f"{slug}-{n}")
    return found


def test_every_relative_link_in_the_docs_resolves():
    broken = []
    for doc in DOCS:
        text = re.sub(r"```.*?```", "", doc.read_text(), flags=re.S)
        for link in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"^[a-z]+://", link):
                continue
            target, _, fragment = link.partition("#")
            path = (doc.parent / target) if target else doc
            if not path.exists():
                broken.append(f"{doc.name}: {link} (no such file)")
            elif fragment and path.suffix == ".md" and fragment not in anchors(path):
                broken.append(f"{doc.name}: {link} (no such heading)")
    assert not broken, broken


def test_every_trace_format_has_an_example_in_traces_md_that_reads_as_that_format(tmp_path):
    text = (REPO / "docs" / "traces.md").read_text()
    for fmt in TRACE_FORMATS[1:]:  # after auto
        assert f"`{fmt}`" in text or f"workload.format={fmt}" in text, fmt
    for fmt in ("azure", "burstgpt", "mooncake", "csv", "jsonl"):
        heading = re.search(rf"^###[^\n]*`workload\.format={fmt}`[^\n]*$", text, re.M)
        assert heading, fmt
        example = re.search(r"```\w*\n(.*?)```", text[heading.end():], re.S).group(1)
        path = tmp_path / f"{fmt}.example"
        path.write_text(example)
        assert detect_format(path, example.splitlines()[0]) == fmt
        requests = load_trace(WorkloadConfig(name="trace", path=str(path)), 0)
        assert len(requests) == 2 and [r.input_error for r in requests] == [None, None], fmt
    assert "`workload=sharegpt_like` is a **synthetic preset**" in " ".join(text.split())
    assert "[docs/traces.md](docs/traces.md)" in (REPO / "README.md").read_text()
    assert "(traces.md)" in (REPO / "docs" / "usage.md").read_text()


def test_the_docs_name_exactly_the_files_an_experiment_arm_writes(tmp_path):
    cfg = composed("progress=false", "workload.num_requests=4", "executor.cost_model=unit")
    arms = {"a": {}, "b": {"scheduler.max_num_seqs": 2}}
    run_experiment(dataclasses.replace(cfg, experiment=ExperimentConfig(name="x", arms=arms)), tmp_path, verbose=False)
    written = {p.name for p in (tmp_path / "a").iterdir()}
    assert written == {p.name for p in (tmp_path / "b").iterdir()}
    for doc in (REPO / "README.md", REPO / "docs" / "usage.md"):
        text = " ".join(doc.read_text().split())
        claim = re.search(r"each arm has its own subfolder holding (.*?)(?:\||\.\s|$)", text)
        assert claim, doc.name
        assert set(re.findall(r"`([^`]+)`", claim.group(1))) == written, doc.name
