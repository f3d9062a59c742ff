"""The README and docs/: every relative link resolves, every anchor names a heading, the README stays short."""

from __future__ import annotations

import re
from pathlib import Path
from urllib.parse import unquote

import pytest

ROOT = Path(__file__).resolve().parents[1]
README_LIMIT = 12_288  # bytes: the README is the front door; the rest lives in docs/

_FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})")
_INLINE_CODE = re.compile(r"(`+)(?!`)(.+?)(?<!`)\1(?!`)", re.S)
_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]*)>?(?:\s+[\"'(][^)]*)?\)")
_REFERENCE = re.compile(r"^ {0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+.*)?$", re.M)
_HTML_ATTR = re.compile(r"<(?:img|a|source)\b[^>]*?\b(?:src|href)\s*=\s*[\"']([^\"']+)[\"']", re.I)
_HTML_ID = re.compile(r"<[a-z][^>]*?\b(?:id|name)\s*=\s*[\"']([^\"']+)[\"']", re.I)
_HEADING = re.compile(r"^ {0,3}(#{1,6})[ \t]+(.*?)(?:[ \t]+#+)?[ \t]*$")


def doc_files() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def _prose_lines(text: str) -> list[str]:
    """The lines outside fenced code blocks (a fenced block's lines become empty)."""
    out, fence = [], None
    for line in text.splitlines():
        m = _FENCE.match(line)
        if fence is None and m:
            fence = m.group(1)[0] * len(m.group(1))
            out.append("")
        elif fence is not None:
            if line.strip().startswith(fence) and not line.strip().strip(fence[0]):
                fence = None
            out.append("")
        else:
            out.append(line)
    return out


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower-case, punctuation dropped (but ``-`` and ``_``), spaces to ``-``."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link in a heading: its text
    text = re.sub(r"<[^>]+>", "", text).strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """The anchors of a markdown file: its headings' slugs (repeats numbered as GitHub does) and HTML ids."""
    seen: dict[str, int] = {}
    out: set[str] = set()
    lines = _prose_lines(path.read_text(encoding="utf-8"))
    for line in lines:
        m = _HEADING.match(line)
        if not m:
            continue
        base = slug(m.group(2))
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    out.update(_HTML_ID.findall("\n".join(lines)))
    return out


def links(path: Path) -> list[str]:
    """Every link target written in a markdown file's prose: ``[text](target)``, ``![alt](target)``,
    ``[ref]: target`` and HTML ``src=``/``href=`` (not inside code)."""
    prose = "\n".join(_prose_lines(path.read_text(encoding="utf-8")))
    prose = _INLINE_CODE.sub(lambda m: "c" * len(m.group(0)), prose)  # `[x](y)` in code is not a link
    return [*_LINK.findall(prose), *_REFERENCE.findall(prose), *_HTML_ATTR.findall(prose)]


def broken_links(path: Path) -> list[str]:
    """The relative links of ``path`` that point at no file, or at no heading of a markdown file."""
    problems = []
    for target in links(path):
        if not target or re.match(r"^(https?:|mailto:)", target, re.I):
            continue
        if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I) or target.startswith("//"):
            problems.append(f"{target}: not a relative link (only http(s) and mailto are external)")
            continue
        file_part, _, anchor = target.partition("#")
        dest = path if not file_part else (path.parent / unquote(file_part)).resolve()
        if not dest.exists():
            problems.append(f"{target}: no such file {dest.relative_to(ROOT) if dest.is_relative_to(ROOT) else dest}")
        elif anchor and dest.suffix.lower() == ".md" and unquote(anchor) not in anchors(dest):
            problems.append(f"{target}: no heading with anchor #{anchor} in {dest.name}")
    return problems


@pytest.mark.parametrize("path", doc_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(path):
    assert broken_links(path) == [], f"{path.relative_to(ROOT)}: broken links"


def test_the_readme_is_short():
    size = (ROOT / "README.md").stat().st_size
    assert size <= README_LIMIT, f"README.md is {size} bytes (at most {README_LIMIT}): move detail to docs/"


def test_the_docs_index_lists_every_page():
    index = ROOT / "docs" / "README.md"
    listed = {(index.parent / t.partition("#")[0]).resolve() for t in links(index)}
    pages = {p.resolve() for p in (ROOT / "docs").rglob("*.md") if p != index}
    assert pages and pages <= listed, sorted(str(p.relative_to(ROOT)) for p in pages - listed)


def test_the_checker_finds_broken_links(tmp_path):
    (tmp_path / "there.md").write_text("# A page\n\n## Its `second` part: notes\n")
    (tmp_path / "pic.png").write_bytes(b"")
    page = tmp_path / "page.md"
    page.write_text(
        "# Title, here\n\n"
        "[ok](there.md) [ok anchor](there.md#its-second-part-notes) [self](#title-here)\n"
        "![picture](pic.png) <img src=\"pic.png\" alt=\"x\"> [web](https://example.com/x) "
        "[mail](mailto:a@b.c)\n"
        "[missing](nowhere.md) [bad anchor](there.md#no-such-part) [bad self](#nothing)\n"
        "![missing picture](gone.png) <img src=\"gone.svg\">\n"
        "`[in code](not-checked.md)`\n\n"
        "```\n[in a fence](not-checked-either.md)\n# not a heading\n```\n"
    )
    assert links(page) == ["there.md", "there.md#its-second-part-notes", "#title-here", "pic.png",
                           "https://example.com/x", "mailto:a@b.c", "nowhere.md", "there.md#no-such-part",
                           "#nothing", "gone.png", "pic.png", "gone.svg"]
    found = broken_links(page)
    assert [p.split(":")[0] for p in found] == ["nowhere.md", "there.md#no-such-part", "#nothing", "gone.png",
                                                "gone.svg"], found
    assert "not-a-heading" not in anchors(page) and "title-here" in anchors(page)


def test_slugs_follow_githubs_rule():
    assert slug("The model file's `settings`") == "the-model-files-settings"
    assert slug("torch.compile") == "torchcompile"
    assert slug("Options: the command line, a config file") == "options-the-command-line-a-config-file"
    assert slug("Items of varying_shape - two") == "items-of-varying_shape---two"
