"""The README and docs/ lead only where something is: every relative link names a file of the
repository and, with a #fragment into a Markdown file, one of its headings (GitHub's anchors); no
file of the repository points outside it to ../shared; every docs/*.md a file cites exists.
Read from the text alone: no Ray, no network."""
from __future__ import annotations

import re
import unicodedata
from pathlib import Path
from urllib.parse import unquote

import pytest

REPO = Path(__file__).resolve().parent.parent
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
OUTSIDE = "../" + "shared"  # spelled in two so that this file does not cite it
TEXT_SUFFIXES = {".md", ".py", ".yaml", ".yml", ".json", ".sh", ".txt", ".toml", ".cfg", ".tpl", ""}
SKIPPED_DIRS = {"__pycache__", "runs", "data", "build", "dist", "node_modules"}

FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})")
ATX_HEADING = re.compile(r"^ {0,3}(#{1,6})[ \t]+(.*?)(?:[ \t]+#+)?[ \t]*$")
SETEXT_UNDERLINE = re.compile(r"^ {0,3}(=+|-+)[ \t]*$")
CODE_SPAN = re.compile(r"(`+)(.+?)(?<!`)\1(?!`)", re.DOTALL)
INLINE_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*<?([^\s)>]*)>?(?:\s+[\"'(].*?[\"')])?\s*\)")
REFERENCE_DEFINITION = re.compile(r"^ {0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s.*)?$", re.MULTILINE)
HTML_LINK = re.compile(r"""\b(?:href|src)\s*=\s*["']([^"']+)["']""")
HTML_ANCHOR = re.compile(r"""<a\s[^>]*\b(?:name|id)\s*=\s*["']([^"']+)["']""")
DOCS_CITATION = re.compile(r"(?<![\w./-])docs/[\w./-]+?\.md\b")


def prose_lines(text: str) -> list[str | None]:
    """The file's lines with fenced code blocks' lines (fences included) as None."""
    lines: list[str | None] = []
    fence: str | None = None
    for line in text.splitlines():
        opening = FENCE.match(line)
        if fence is None and opening:
            fence = opening.group(1)
            lines.append(None)
        elif fence is not None:
            closing = FENCE.match(line)
            if closing and closing.group(1)[0] == fence[0] and len(closing.group(1)) >= len(fence) \
                    and not line.strip().lstrip(fence[0]):
                fence = None
            lines.append(None)
        else:
            lines.append(line)
    return lines


def prose(text: str) -> str:
    """The text outside fenced blocks and code spans (a link inside either is not a link)."""
    outside_fences = "\n".join(line if line is not None else "" for line in prose_lines(text))
    return CODE_SPAN.sub(lambda span: " " * len(span.group(0)), outside_fences)


def anchor(heading: str) -> str:
    """GitHub's anchor for a heading's text: inline markup reduced to its text, lowercased,
    everything but letters, digits, '_', '-' and spaces dropped, spaces made '-'."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link counts by its text
    text = re.sub(r"<[^>]+>", "", text)  # inline HTML
    text = text.replace("`", "").lower()
    kept = "".join(ch for ch in text
                   if ch in " -_" or unicodedata.category(ch)[0] in "LN")
    return kept.replace(" ", "-")


def anchors(text: str) -> set[str]:
    """Every anchor a Markdown file offers: its headings' (ATX and setext; a repeated one gets
    -1, -2, ... as GitHub numbers them) and its HTML anchors' names."""
    found: set[str] = set()
    seen: dict[str, int] = {}
    lines = prose_lines(text)
    for index, line in enumerate(lines):
        if line is None:
            continue
        heading = ATX_HEADING.match(line)
        title = heading.group(2) if heading else None
        following = lines[index + 1] if index + 1 < len(lines) else None
        if title is None and following is not None and SETEXT_UNDERLINE.match(following) and line.strip() \
                and not re.match(r"^ {0,3}([-*+>|]|\d+[.)])", line):
            title = line.strip()
        if title is None:
            continue
        base = anchor(title)
        count = seen.get(base, 0)
        seen[base] = count + 1
        found.add(base if count == 0 else f"{base}-{count}")
    found.update(HTML_ANCHOR.findall(prose(text)))
    return found


def links(text: str) -> list[str]:
    """Every link target of a Markdown file: inline links and images, reference definitions,
    HTML href/src; in fenced blocks and code spans none."""
    readable = prose(text)
    return [*INLINE_LINK.findall(readable), *REFERENCE_DEFINITION.findall(readable),
            *HTML_LINK.findall(readable)]


def broken_links(page: Path, repo: Path = REPO) -> list[str]:
    """What is wrong with each relative link of ``page``, a file of ``repo`` (empty when nothing is)."""
    problems = []
    for target in links(page.read_text(encoding="utf-8")):
        if not target or re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*:", target) or target.startswith("//"):
            continue  # a URL (http:, mailto:, ...): not this test's to check
        path_part, _, fragment = target.partition("#")
        where = page if not path_part else (page.parent / unquote(path_part)).resolve()
        if OUTSIDE in target or (path_part and repo.resolve() not in [where, *where.parents]):
            problems.append(f"{target}: outside the repository")
        elif not where.exists():
            problems.append(f"{target}: no such file")
        elif fragment and where.is_file() and where.suffix == ".md" \
                and unquote(fragment).lower() not in anchors(where.read_text(encoding="utf-8")):
            problems.append(f"{target}: {where.name} has no heading with the anchor #{fragment}")
    return problems


def repository_text_files() -> list[Path]:
    """The repository's text files, this one (whose examples name missing files) left out."""
    files = []
    for path in REPO.rglob("*"):
        parts = path.relative_to(REPO).parts
        if any(part.startswith(".") and part != ".ci" or part in SKIPPED_DIRS or part.endswith(".egg-info")
               for part in parts[:-1]):
            continue
        if path.is_file() and path.suffix in TEXT_SUFFIXES and not parts[-1].startswith(".") \
                and path != Path(__file__).resolve():
            files.append(path)
    return files


def test_github_anchors_are_made_as_github_makes_them():
    # the anchors GitHub gives these headings (read off rendered pages)
    assert anchor("What survives what") == "what-survives-what"
    assert anchor("On a laptop: fake multi-node cluster") == "on-a-laptop-fake-multi-node-cluster"
    assert anchor("On a Ray cluster (cluster launcher)") == "on-a-ray-cluster-cluster-launcher"
    assert anchor("ZeRO-1") == "zero-1"
    assert anchor("The `p2p` executor's step") == "the-p2p-executors-step"
    assert anchor("Words for layout changes") == "words-for-layout-changes"
    assert anchors("# A\n## A\n```\n# not a heading\n```\nB b\n---\n") == {"a", "a-1", "b-b"}


def test_broken_links_and_anchors_are_found(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "guide.md").write_text("# Guide\n\n## Failures and heals\n")
    page = tmp_path / "README.md"
    page.write_text("[ok](docs/guide.md#failures-and-heals) [top](#readme) `[code](nowhere.md)`\n"
                    "[gone](docs/missing.md) [bad anchor](docs/guide.md#failures)\n"
                    f"[outside]({OUTSIDE}/DESIGN.md) [web](https://example.com/x.md#y)\n\n# README\n"
                    "```\n[fenced](nowhere.md)\n```\n")
    assert broken_links(page, tmp_path) == ["docs/missing.md: no such file",
                                  "docs/guide.md#failures: guide.md has no heading with the anchor #failures",
                                  f"{OUTSIDE}/DESIGN.md: outside the repository"]


@pytest.mark.parametrize("page", PAGES, ids=[str(page.relative_to(REPO)) for page in PAGES])
def test_every_relative_link_leads_to_a_file_and_heading_that_exist(page):
    assert broken_links(page) == []


def test_nothing_in_the_repository_points_to_the_shared_folder_outside_it():
    citing = [f"{path.relative_to(REPO)}:{number}" for path in repository_text_files()
              for number, line in enumerate(path.read_text(encoding="utf-8", errors="replace").splitlines(), 1)
              if OUTSIDE in line]
    assert citing == []


def test_every_docs_page_the_repository_cites_exists():
    missing = [f"{path.relative_to(REPO)}:{number}: {cited}" for path in repository_text_files()
               for number, line in enumerate(path.read_text(encoding="utf-8", errors="replace").splitlines(), 1)
               for cited in DOCS_CITATION.findall(line) if not (REPO / cited).is_file()]
    assert missing == []
