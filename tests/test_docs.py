"""The documentation holds together: every relative link in README.md and docs/**/*.md points at
a file that exists (and, for a `#anchor` into a markdown file, at a heading that exists); the
README stays short and names the two commands the Makefile defines.

Pure text checks (no jax), so they run in well under a second.
"""

from __future__ import annotations

import pathlib
import re
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
README_MAX_LINES = 220
COMMANDS = ("make run", "make test")

# [text](target) and ![alt](target); the target ends at whitespace or ')' (an optional "title"
# after a space is ignored).
_LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_FENCE = re.compile(r"^\s*(```|~~~)")
_CODE_SPAN = re.compile(r"`[^`]*`")
_SCHEME = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")


def doc_files() -> list[pathlib.Path]:
  """README.md and every markdown file under docs/."""
  return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def _prose_lines(text: str):
  """(line number, line) outside fenced code blocks, with inline code spans blanked."""
  fenced = False
  for n, line in enumerate(text.splitlines(), 1):
    if _FENCE.match(line):
      fenced = not fenced
      continue
    if not fenced:
      yield n, _CODE_SPAN.sub("", line)


def links(text: str) -> list[tuple[int, str]]:
  """(line number, target) of every markdown link and image in prose."""
  return [(n, m.group(1)) for n, line in _prose_lines(text) for m in _LINK.finditer(line)]


def slug(heading: str) -> str:
  """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
  s = heading.strip().lower()
  s = re.sub(r"[^\w\- ]", "", s)
  return s.replace(" ", "-")


def anchors(text: str) -> set[str]:
  """Anchors of the markdown headings of `text` (repeats get -1, -2, ... as on GitHub)."""
  seen: dict[str, int] = {}
  out = set()
  for _, line in _prose_lines(text):
    m = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
    if not m:
      continue
    base = slug(m.group(1))
    k = seen.get(base, 0)
    seen[base] = k + 1
    out.add(base if k == 0 else f"{base}-{k}")
  return out


def broken_links(path: pathlib.Path) -> list[str]:
  """'file:line: target (why)' for every relative link of `path` that does not resolve."""
  text = path.read_text(encoding="utf-8")
  bad = []
  for n, target in links(text):
    if _SCHEME.match(target):          # http:, https:, mailto: ... are not checked here
      continue
    file_part, _, anchor = target.partition("#")
    dest = (path.parent / file_part).resolve() if file_part else path
    where = f"{path.relative_to(ROOT)}:{n}: {target}"
    if not dest.exists():
      bad.append(f"{where} (no such file)")
    elif anchor and dest.suffix == ".md" and dest.is_file():
      if anchor not in anchors(dest.read_text(encoding="utf-8")):
        bad.append(f"{where} (no heading with anchor #{anchor} in {dest.name})")
  return bad


@pytest.mark.parametrize("path", doc_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(path):
  bad = broken_links(path)
  assert not bad, "broken links (fix the path, or the heading it points at):\n" + "\n".join(bad)


def test_the_checker_finds_broken_links(tmp_path, monkeypatch):
  """The checker itself can fail: a missing file, a missing anchor and a link hidden in code."""
  monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
  (tmp_path / "there.md").write_text("# A heading: with (punctuation)\n\n## Twice\n\n## Twice\n")
  doc = tmp_path / "doc.md"
  doc.write_text(
      "[ok](there.md) [ok too](there.md#a-heading-with-punctuation) [again](there.md#twice-1)\n"
      "![missing](img/nothing.png) [bad anchor](there.md#no-such-heading)\n"
      "[web](https://example.com/x) `[in code](nowhere.md)`\n"
      "```\n[in a fence](nowhere.md)\n```\n")
  bad = broken_links(doc)
  assert len(bad) == 2, bad
  assert "img/nothing.png (no such file)" in bad[0]
  assert "#no-such-heading" in bad[1]


def test_readme_is_short():
  n = len((ROOT / "README.md").read_text(encoding="utf-8").splitlines())
  assert n <= README_MAX_LINES, (
      f"README.md has {n} lines (at most {README_MAX_LINES}): move how-to material to "
      "docs/guides/ and results to docs/results/ or docs/benchmark/")


def test_readme_names_the_two_commands():
  readme = (ROOT / "README.md").read_text(encoding="utf-8")
  makefile = (ROOT / "Makefile").read_text(encoding="utf-8")
  for command in COMMANDS:
    target = command.split()[1]
    assert re.search(rf"^{target}:", makefile, re.M), f"the Makefile has no `{target}` target"
    assert re.search(rf"^{re.escape(command)}\s", readme, re.M), (
        f"README.md must show `{command}` at the start of a line (in the commands block)")
