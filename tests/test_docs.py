"""The README stays short and its quickstart exact; every relative link in the docs resolves."""

import re

from conftest import REPO

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
