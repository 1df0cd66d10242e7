"""The documentation (issue 46): the pages under ``docs/`` build into a site with mkdocs ``--strict``
(``mkdocs.yml``: a broken link, a missing anchor or a page left out of the nav is a warning, and strict makes
it an error), and a build with a broken link does fail; the front page (``README.md``) and ``CHANGELOG.md``,
which live outside the site, link only to files that exist and to anchors the built pages hold; the README
stays a front page of at most 200 lines whose first two commands are the demo and the test command, the one
``.ci/run`` runs."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")  # [text](target), not images
CODE_BLOCK = re.compile(r"```[^\n]*\n(.*?)```", re.S)
TABLE_RULE = re.compile(r"^\|[-:| ]+\|$")  # a table's second line: |---|:--|
MAX_README_LINES = 200
MISSING_PAGE = "no-such-page" + ".md"  # spelt in two parts: test_layout checks the documents a file names


def mkdocs_build(project: Path, site: Path) -> subprocess.CompletedProcess:
    """``mkdocs build --strict`` of ``project/mkdocs.yml`` into ``site``; skips (fails in CI) without mkdocs."""
    try:
        import mkdocs  # noqa: F401
    except ImportError:
        reason = "mkdocs is not installed: pip install -e '.[docs]' (deploy/setup.sh --test installs it)"
        if os.environ.get("CI"):
            pytest.fail(reason)
        pytest.skip(reason)
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}  # mkdocs-material's banner about its successor
    return subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file",
                           str(project / "mkdocs.yml"), "--site-dir", str(site)],
                          capture_output=True, text=True, timeout=300, cwd=project, env=env)


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    """The repository's docs site, built once for this module."""
    out = tmp_path_factory.mktemp("site") / "site"
    build = mkdocs_build(ROOT, out)
    print(build.stdout + build.stderr)
    assert build.returncode == 0, build.stderr
    assert "WARNING" not in build.stderr, build.stderr
    return out


def page_html(site: Path, page: Path) -> Path:
    """The built HTML of the markdown file ``page`` under docs/ (``docs/README.md`` is the site's index)."""
    rel = page.relative_to(DOCS).with_suffix("")
    return site / "index.html" if rel.name in ("README", "index") else site / rel / "index.html"


def test_every_page_builds_strict(site):
    pages = sorted(DOCS.rglob("*.md"))
    assert len(pages) >= 15, pages
    for page in pages:
        assert page_html(site, page).is_file(), page


def test_a_broken_link_or_anchor_fails_the_build(tmp_path):
    """The strict build has teeth: one missing page, one missing anchor in another page, one on the same page."""
    shutil.copytree(DOCS, tmp_path / "docs")
    shutil.copy(ROOT / "mkdocs.yml", tmp_path / "mkdocs.yml")
    with (tmp_path / "docs" / "apis.md").open("a") as f:
        f.write(f"\n[a]({MISSING_PAGE}) [b](chat.md#no-such-anchor) [c](#nor-here)\n")
    build = mkdocs_build(tmp_path, tmp_path / "site")
    print(build.stderr)
    assert build.returncode != 0
    for target in (MISSING_PAGE, "#no-such-anchor", "#nor-here"):
        assert target in build.stderr, target


def _anchors(html: Path) -> set[str]:
    return set(re.findall(r'\bid="([^"]+)"', html.read_text()))


def _heading_slugs(markdown: Path) -> set[str]:
    """The anchors of a markdown file's headings as the site and GitHub make them (python-markdown's slugify)."""
    from markdown.extensions.toc import slugify

    text = CODE_BLOCK.sub("", markdown.read_text())
    return {slugify(re.sub(r"[`*]", "", h), "-") for h in re.findall(r"^#+ (.+)$", text, re.M)}


@pytest.mark.parametrize("name", ["README.md", "CHANGELOG.md"])
def test_links_outside_the_site_resolve(site, name):
    """README.md and CHANGELOG.md link to files of the repository, and to anchors the built pages hold."""
    source = ROOT / name
    checked, broken = 0, []
    for target in LINK.findall(CODE_BLOCK.sub("", source.read_text())):
        if re.match(r"[a-z]+:", target):
            continue  # a URL
        path, _, anchor = target.partition("#")
        file = (source.parent / path).resolve() if path else source
        checked += 1
        if not file.is_file():
            broken.append(f"{target}: no such file")
        elif anchor:
            if file == source or not file.is_relative_to(DOCS):
                anchors = _heading_slugs(file)
            else:
                anchors = _anchors(page_html(site, file))
            if anchor not in anchors:
                broken.append(f"{target}: no such anchor")
    print(f"{name}: {checked} links checked")
    assert not broken, broken
    assert checked >= (20 if name == "README.md" else 1)


def test_the_readme_is_a_front_page_whose_first_commands_are_the_demo_and_the_tests():
    readme = (ROOT / "README.md").read_text()
    lines = readme.splitlines()
    print(f"README.md: {len(lines)} lines")
    assert len(lines) <= MAX_README_LINES
    blocks = [b.strip() for b in CODE_BLOCK.findall(readme)]
    commands = [b for b in blocks if b.startswith("bash ")]
    assert commands[:2] == ["bash deploy/demo.sh", "bash deploy/test.sh"]
    assert readme.index("bash deploy/demo.sh") < readme.index("bash deploy/test.sh") < readme.index("## Quickstart")
    ci = (ROOT / ".ci" / "run").read_text()
    assert re.search(r"^bash deploy/test\.sh\b", ci, re.M), ci  # CI runs the README's test command


def test_every_table_has_its_header_and_rule():
    """A table split by a stray line renders as text on GitHub and in the site without a warning: each table's
    first row is followed by its rule, and each rule follows a header row."""
    broken = []
    for path in [ROOT / "README.md", ROOT / "CHANGELOG.md", *sorted(DOCS.rglob("*.md"))]:
        lines = CODE_BLOCK.sub(lambda m: "\n" * m.group(0).count("\n"), path.read_text()).splitlines()
        for i, line in enumerate(lines):
            starts = line.startswith("|") and (i == 0 or not lines[i - 1].startswith("|"))
            if TABLE_RULE.match(line) and starts:
                broken.append(f"{path.relative_to(ROOT)}:{i + 1}: a rule without a header row")
            elif starts and not (i + 1 < len(lines) and TABLE_RULE.match(lines[i + 1])):
                broken.append(f"{path.relative_to(ROOT)}:{i + 1}: a table without its rule")
    assert not broken, broken
