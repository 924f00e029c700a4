"""The README and docs/ stay navigable: short README, every page linked, every link and repository path real.

Links and code spans come from markdown-it's token stream (what a code host renders), not from regexes over raw
text, so code blocks and escaped text are not mistaken for links.
"""
import re
from pathlib import Path
from urllib.parse import unquote, urlparse

import pytest
from markdown_it import MarkdownIt

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
README_MAX_LINES = 200
# Backticked tokens under these roots name files of this repository and must exist.
REPO_ROOTS = ("scripts/", "bench/", "docs/", "src/", "tests/", ".ci/")
REPO_FILES = ("README.md", "prefect.yaml", "pyproject.toml")
# Placeholders and globs in a path (`runs/<run>/...`, `bench/results/*.json`) name no single file.
PLACEHOLDER = re.compile(r"[<>*{}$…]|\.\.\.")
FORBIDDEN = ("NOTES.md", "DESIGN.md")

_md = MarkdownIt("commonmark").enable("table")


def doc_pages() -> list[Path]:
    return sorted((REPO / "docs").glob("*.md"))


def all_docs() -> list[Path]:
    return [README, *doc_pages()]


def _inline_tokens(path: Path):
    for token in _md.parse(path.read_text(encoding="utf-8")):
        if token.type == "inline":
            yield from token.children or ()


def links(path: Path) -> list[str]:
    return [t.attrs["href"] for t in _inline_tokens(path) if t.type == "link_open"] + \
           [t.attrs["src"] for t in _inline_tokens(path) if t.type == "image"]


def code_spans(path: Path) -> list[str]:
    return [t.content for t in _inline_tokens(path) if t.type == "code_inline"]


def github_slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation other than '-' and '_' dropped, spaces to '-'."""
    text = heading.strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    tokens = _md.parse(path.read_text(encoding="utf-8"))
    seen: dict[str, int] = {}
    found = set()
    for opening, inline in zip(tokens, tokens[1:]):
        if opening.type != "heading_open":
            continue
        text = "".join(c.content for c in inline.children or () if c.type in ("text", "code_inline"))
        slug = github_slug(text)
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        found.add(slug if count == 0 else f"{slug}-{count}")
    return found


def broken_links(path: Path) -> list[str]:
    broken = []
    for href in links(path):
        parsed = urlparse(href)
        if parsed.scheme or href.startswith("//"):
            continue                                   # external: not checked offline
        target = (path.parent / unquote(parsed.path)).resolve() if parsed.path else path
        if not target.exists():
            broken.append(f"{href}: no file {target.relative_to(REPO) if target.is_relative_to(REPO) else target}")
        elif parsed.fragment and target.suffix == ".md" and parsed.fragment not in anchors(target):
            broken.append(f"{href}: no heading #{parsed.fragment} in {target.name}")
    return broken


def repo_paths(path: Path) -> list[str]:
    """Tokens of inline code that name a repository file or folder (`scripts/run.sh`, `tests/serve`)."""
    found = []
    for span in code_spans(path):
        for token in span.split():
            token = token.rstrip(".,:;)").lstrip("(")
            if PLACEHOLDER.search(token):
                continue
            if token.startswith(REPO_ROOTS) or token in REPO_FILES:
                found.append(token)
    return found


def test_readme_is_short():
    lines = len(README.read_text(encoding="utf-8").splitlines())
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines; move detail into docs/"


def test_every_docs_page_is_linked_from_the_readme():
    linked = {(README.parent / urlparse(h).path).resolve() for h in links(README) if not urlparse(h).scheme}
    missing = [p.name for p in doc_pages() if p.resolve() not in linked]
    assert doc_pages(), "docs/ has no pages"
    assert not missing, f"docs pages not linked from README.md: {missing}"


@pytest.mark.parametrize("path", all_docs(), ids=lambda p: str(p.relative_to(REPO)))
def test_relative_links_resolve(path):
    assert not broken_links(path)


@pytest.mark.parametrize("path", all_docs(), ids=lambda p: str(p.relative_to(REPO)))
def test_backticked_repository_paths_exist(path):
    missing = [p for p in repo_paths(path) if not (REPO / p).exists()]
    assert not missing, f"{path.name} names paths that do not exist: {missing}"


@pytest.mark.parametrize("path", all_docs(), ids=lambda p: str(p.relative_to(REPO)))
def test_no_files_outside_the_repository_cited(path):
    text = path.read_text(encoding="utf-8")
    cited = [name for name in FORBIDDEN if name in text]
    assert not cited, f"{path.name} cites {cited}, which are not part of the repository"


def test_the_checks_catch_what_they_check(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("# Title\n\n[ok](#title) [gone](missing.md) [bad anchor](#nowhere) `scripts/nope.sh`\n",
                    encoding="utf-8")
    assert github_slug("What `scripts/run.sh` does") == "what-scriptsrunsh-does"
    assert github_slug("GLM-4.5 / 4.6 / 4.7: mixture-of-experts bases") == "glm-45--46--47-mixture-of-experts-bases"
    assert [b.split(":")[0] for b in broken_links(page)] == ["missing.md", "#nowhere"]
    assert repo_paths(page) == ["scripts/nope.sh"]
