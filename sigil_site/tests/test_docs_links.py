"""Every relative link and #anchor in README.md and docs/*.md resolves, and every page of
docs/ is linked from the README: the docs are the contract, and a link that leads nowhere
is a broken promise."""

import re
from pathlib import Path

BASE_DIR = Path(__file__).resolve().parents[2]
PAGES = [BASE_DIR / "README.md", *sorted((BASE_DIR / "docs").glob("*.md"))]

FENCE = re.compile(r"^```.*?^```", re.MULTILINE | re.DOTALL)
CODE_SPAN = re.compile(r"`[^`\n]*`")
LINK = re.compile(r"\[(?:[^\[\]]|\[[^\]]*\])*\]\(([^()\s]+)\)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$", re.MULTILINE)


def prose(text: str) -> str:
    """The text outside code fences and code spans, where a link is a link."""
    return CODE_SPAN.sub("", FENCE.sub("", text))


def slug(heading: str) -> str:
    """The anchor GitHub gives a heading: its text lowercased, punctuation dropped, spaces
    turned into hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading).replace("`", "")
    return re.sub(r"[^\w\- ]", "", text.lower()).replace(" ", "-")


def anchors(text: str) -> set[str]:
    """Every anchor the page's headings give, repeated ones numbered as GitHub numbers them."""
    found: set[str] = set()
    seen: dict[str, int] = {}
    for _, heading in HEADING.findall(FENCE.sub("", text)):
        base = slug(heading)
        n = seen.get(base, 0)
        seen[base] = n + 1
        found.add(base if n == 0 else f"{base}-{n}")
    return found


def broken_links(page: Path) -> list[str]:
    """The relative links of `page` whose file or anchor is missing."""
    broken = []
    for target in LINK.findall(prose(page.read_text())):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):
            continue  # http:, https:, mailto: lead outside the repository
        path, _, anchor = target.partition("#")
        linked = (page.parent / path).resolve() if path else page
        missing = not linked.exists()
        if missing or (anchor and (linked.suffix != ".md" or anchor not in anchors(linked.read_text()))):
            broken.append(target)
    return broken


def test_the_pages_link_somewhere():
    assert sum(len(LINK.findall(prose(page.read_text()))) for page in PAGES) > 50


def test_every_relative_link_and_anchor_resolves():
    assert {page.relative_to(BASE_DIR).as_posix(): broken_links(page) for page in PAGES if broken_links(page)} == {}


def test_every_docs_page_is_linked_from_the_readme():
    linked = {(BASE_DIR / target.partition("#")[0]).resolve() for target in LINK.findall(prose(PAGES[0].read_text()))}
    assert [page.name for page in PAGES[1:] if page.resolve() not in linked] == []


def test_a_missing_file_or_anchor_is_found(tmp_path):
    (tmp_path / "other.md").write_text("# Other page\n\n## A `code` heading: here\n\n## Again\n\n## Again\n")
    page = tmp_path / "page.md"
    page.write_text(
        "# Page\n\n[fine](other.md#a-code-heading-here) [fine](other.md#again-1) [fine](#page)\n"
        "[gone](missing.md) [gone](other.md#nowhere) [gone](#elsewhere) `[code](missing.md)`\n"
        "```\n[fenced](missing.md)\n```\n[out](https://example.com/x)\n"
    )
    assert broken_links(page) == ["missing.md", "other.md#nowhere", "#elsewhere"]
