"""The README stays short and its quickstart exact; every relative link in the docs resolves;
every code path and `cbjax.` module a doc names exists; the trace guide's examples read as their
formats; the docs list what an experiment arm writes; the cluster guide's commands compose."""

import ast
import dataclasses
import functools
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


# a path token a doc names, repository-relative; or one of cbjax's packages (`runtime/batch.py`)
ROOTS = ("cbjax", "benchmarks", "experiments", "configs", "tests", "docs")
PACKAGES = tuple(p.name for p in (REPO / "cbjax").iterdir() if (p / "__init__.py").is_file())
PATH_TOKEN = re.compile(r"^(?:%s)/[\w./-]*$" % "|".join(ROOTS + PACKAGES))
PATH_SUFFIXES = (".py", ".sh", ".yaml", ".md", ".cc", ".h", ".csv", ".json")
MODULE_TOKEN = re.compile(r"^cbjax(?:\.\w+)+$")
# packages installed under another name than their folder (setup.py)
INSTALLED_AS = {"cbjax.configs": "configs"}


def code_tokens(text: str) -> set[tuple[str, bool]]:
    """The words of a markdown text's code: (word, inline) for inline code spans and fenced blocks."""
    blocks = re.findall(r"```[^\n]*\n(.*?)```", text, flags=re.S)
    spans = re.findall(r"`([^`]+)`", re.sub(r"```.*?```", "", text, flags=re.S))  # a span may wrap
    words = {(w, False) for block in blocks for w in block.split()} | {(w, True) for span in spans for w in span.split()}
    return {(w.strip("()[],;:'\""), inline) for w, inline in words}


def defined_names(source: str) -> set[str]:
    """Every name a module's source defines at any depth: functions, classes, assignments
    (attributes of `self` included) and imports."""
    names = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            names.add(node.attr)
    return names


def module_resolves(dotted: str) -> bool:
    """Whether `cbjax.a.b.c` is a module of the checkout or names defined in one, found without
    importing anything (the longest prefix that is a module file or package, then each further
    name defined in that module's source)."""
    parts = dotted.split(".")
    for n in range(len(parts), 0, -1):
        head = ".".join(parts[:n])
        folder = REPO / INSTALLED_AS.get(head, "/".join(parts[:n]))
        source = folder.with_suffix(".py") if folder.with_suffix(".py").is_file() else folder / "__init__.py"
        if not source.is_file():
            continue
        names = defined_names(source.read_text())
        return all(name in names for name in parts[n:])
    return False


@functools.cache
def class_members() -> dict[str, set[str]]:
    """Each class cbjax defines, by name: the names its module's source defines (a class name two
    modules define gets both modules' names)."""
    members: dict[str, set[str]] = {}
    for path in (REPO / "cbjax").rglob("*.py"):
        source = path.read_text()
        classes = [n.name for n in ast.walk(ast.parse(source)) if isinstance(n, ast.ClassDef)]
        for name in classes:
            members.setdefault(name, set()).update(defined_names(source))
    return members


CLASS_MEMBER = re.compile(r"^([A-Z]\w*)\.(\w+)(?:\(|$)")  # `Class.name`, `Class.name()`, `Class.name(arg, ...`


def stale_references(text: str) -> list[str]:
    """The repository paths, `cbjax.` modules and members of cbjax's classes a markdown text names
    that do not exist. A path is a file (by its suffix) or, in inline code, a folder; a fenced
    block's other words are a command's arguments."""
    stale, members = set(), class_members()
    for token, inline in code_tokens(text):
        if any(c in token for c in "<>*{}$"):
            continue  # a pattern or a placeholder, not a path
        token = token.rstrip(".")
        if PATH_TOKEN.match(token):
            root = REPO if token.split("/")[0] in ROOTS else REPO / "cbjax"
            if (token.endswith(PATH_SUFFIXES) or inline) and not (root / token).exists():
                stale.add(token)
        elif MODULE_TOKEN.match(token) and not module_resolves(token):
            stale.add(token)
        elif (m := CLASS_MEMBER.match(token)) and m.group(1) in members and m.group(2) not in members[m.group(1)]:
            stale.add(token)  # `EngineLoop.cancel`: a class of cbjax's, a name its module lacks
    return sorted(stale)


def test_a_doc_naming_a_missing_path_or_module_is_caught():
    text = (
        "Run `python experiments/no_such_script.py`, read `cbjax/core/plan.py` and `runtime/nope.py`;\n"
        "```bash\nbash experiments/gone.sh --tokenizer cbjax/byte\n```\n"
        "`cbjax.engine.loop.EngineLoop`, `cbjax.engine.loop.NoSuchThing`, `cbjax.nowhere`, `cbjax.configs`,\n"
        "`EngineLoop.step`, `EngineLoop.no_such_method`, `OtherProject.anything`."
    )
    assert stale_references(text) == [
        "EngineLoop.no_such_method", "cbjax.engine.loop.NoSuchThing", "cbjax.nowhere", "experiments/gone.sh",
        "experiments/no_such_script.py", "runtime/nope.py",
    ]  # fmt: skip


def test_every_code_path_and_module_the_docs_name_exists():
    stale = {doc.name: found for doc in DOCS if (found := stale_references(doc.read_text()))}
    assert not stale, stale


def test_every_trace_format_has_an_example_in_traces_md_that_reads_as_that_format(tmp_path):
    text = (REPO / "docs" / "traces.md").read_text()
    for fmt in TRACE_FORMATS[1:]:  # after auto
        assert f"`{fmt}`" in text or f"workload.format={fmt}" in text, fmt
    for fmt in ("azure", "burstgpt", "mooncake", "sharegpt", "csv", "jsonl"):
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


def test_usage_lists_every_reproduction_experiment():
    import yaml

    text = (REPO / "docs" / "usage.md").read_text()
    section = text.split("## Reproducing papers", 1)[1].split("\n## ", 1)[0]
    listed = set(re.findall(r"^\| `(\w+)` \|", section, flags=re.M))
    reproductions = set()
    for path in (REPO / "configs" / "experiment").glob("*.yaml"):
        if (yaml.safe_load(path.read_text()).get("experiment") or {}).get("reproduction"):
            reproductions.add(path.stem)
    assert reproductions and listed == reproductions


def doc_commands(path, prog="cbjax"):
    """The `prog` command lines of a doc's shell blocks: continuations joined, comments dropped."""
    out = []
    for block in re.findall(r"```bash\n(.*?)```", path.read_text(), flags=re.S):
        for line in block.replace("\\\n", " ").splitlines():
            words = line.split("#")[0].split()
            if words[:1] == [prog]:
                out.append(words[1:])
    return out


def test_the_cluster_guides_commands_compose():
    commands = doc_commands(REPO / "docs" / "cluster.md")
    assert len(commands) >= 6
    for overrides in commands:
        composed(*overrides)  # a key the schema lacks, or one added without its `+`, fails here
