"""The documents hold together: every relative link and anchor resolves, every manual in docs/ is
reachable from the README, and the README's command table lists every command the CLI has."""
from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DOCUMENTS = sorted([REPO / "README.md", REPO / "ARCHITECTURE.md", REPO / "BENCHMARKS.md",
                    *(REPO / "docs").glob("*.md")])
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
INLINE_CODE = re.compile(r"`[^`]*`")


def prose_lines(text: str):
    """(line number, line) outside fenced code blocks: a link or heading in code is not one."""
    fenced = False
    for number, line in enumerate(text.splitlines(), 1):
        if line.lstrip().startswith("```"):
            fenced = not fenced
        elif not fenced:
            yield number, line


def github_anchor(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"<[^>]+>", "", heading).strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every heading's anchor in a markdown file; a repeated one gets -1, -2, ... as on GitHub."""
    seen: dict[str, int] = {}
    found = set()
    for _, line in prose_lines(path.read_text()):
        match = re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if match:
            base = github_anchor(match.group(1))
            count = seen.get(base, 0)
            seen[base] = count + 1
            found.add(base if count == 0 else f"{base}-{count}")
    return found


def relative_links(path: Path):
    """(line number, target) of every link in a document that is not to another site."""
    for number, line in prose_lines(path.read_text()):
        for match in LINK.finditer(INLINE_CODE.sub("``", line)):  # not links shown as code
            target = match.group(1)
            if not re.match(r"[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
                yield number, target


def test_the_anchor_rule_matches_github():
    assert github_anchor("Parallelism: tensor x pipeline x data (x context)") == \
        "parallelism-tensor-x-pipeline-x-data-x-context"
    assert github_anchor("Speed levers against `transformers`") == \
        "speed-levers-against-transformers"
    assert github_anchor("muP: learning-rate transfer across widths") == \
        "mup-learning-rate-transfer-across-widths"


def broken_links(document: Path) -> list[str]:
    """`line: target: why` for each relative link whose file or heading does not exist."""
    broken = []
    for number, target in relative_links(document):
        path, _, anchor = target.partition("#")
        destination = (document.parent / path).resolve() if path else document
        where = f"{document.name}:{number}: {target}"
        if not destination.exists():
            broken.append(f"{where}: no such file")
        elif anchor and destination.suffix != ".md":
            broken.append(f"{where}: an anchor into a file that is not markdown")
        elif anchor and anchor not in anchors(destination):
            broken.append(f"{where}: no heading with that anchor in {destination.name}")
    return broken


@pytest.mark.parametrize("document", DOCUMENTS, ids=lambda p: str(p.relative_to(REPO)))
def test_every_relative_link_and_anchor_resolves(document):
    broken = broken_links(document)
    assert not broken, "\n".join(broken)


def test_the_link_check_finds_missing_files_and_headings(tmp_path):
    (tmp_path / "other.md").write_text("# Other page\n\n## A section: with `code` (and more)\n"
                                       "```\n# a comment in a code block, not a heading\n```\n")
    (tmp_path / "picture.png").write_bytes(b"")
    page = tmp_path / "page.md"
    page.write_text("# Page\n\n[ok](other.md#a-section-with-code-and-more) [ok](#page)\n"
                    "![ok](picture.png) [web](https://example.com/x.md)\n"
                    "[gone](missing.md) "
                    "[no heading](other.md#a-comment-in-a-code-block-not-a-heading)\n"
                    "[self](#nowhere) [png](picture.png#top)\n"
                    "`[shown as code](missing.md)`\n```\n[in a code block](missing.md)\n```\n")
    assert broken_links(page) == [
        "page.md:5: missing.md: no such file",
        "page.md:5: other.md#a-comment-in-a-code-block-not-a-heading: no heading with that "
        "anchor in other.md",
        "page.md:6: #nowhere: no heading with that anchor in page.md",
        "page.md:6: picture.png#top: an anchor into a file that is not markdown"]


def test_every_manual_in_docs_is_linked_from_the_readme():
    readme_targets = {target.partition("#")[0] for _, target in relative_links(REPO / "README.md")}
    manuals = {f"docs/{page.name}" for page in (REPO / "docs").glob("*.md")}
    assert manuals, "docs/ holds no manual"
    assert not manuals - readme_targets, \
        f"not linked from README.md: {sorted(manuals - readme_targets)}"


def test_the_readme_command_table_lists_every_command():
    from pretrain.cli import build_parser

    subparsers = next(action for action in build_parser()._actions
                      if isinstance(action, argparse._SubParsersAction))
    readme = (REPO / "README.md").read_text()
    missing = [name for name in subparsers.choices if f"| `pretrain {name}" not in readme]
    assert not missing, f"commands missing from the README's command table: {missing}"
