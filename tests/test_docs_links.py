"""Every cross-reference in the docs and the code leads somewhere: markdown links in README.md and
docs/*.md (relative files and `#anchor`s), repository paths named in prose and code
(`distca_jax/schedule/relay.py`, `docs/METHOD.md`), and sections cited by title
(`docs/PERFORMANCE.md, "Dispatch at scale"`, `METHOD.md#relayed-kv`). A dead one fails with
its file and line. Text only: nothing is imported or run."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# Where references are read: the docs a reader follows (dated logs keep what was true then, and
# are linked to, not from), and the code's comments and docstrings.
DOCS = ["README.md", *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md"))]
CODE_DIRS = ("distca_jax", "models", "kernels", "launch", "tests", "configs")
# Files whose paths name another tree than the repository's (an installed wheel's layout, this
# test's own planted examples).
OTHER_TREES = {"tests/test_package.py", "tests/test_docs_links.py"}

_LINK = re.compile(r"\]\(([^)\s]+)\)")
_PATH = re.compile(r"(?<![\w/.$<{:-])((?:distca_jax|launch|docs|kernels|models|configs|tests)/"
                   r"[\w./-]*\w\.(?:py|md|json|yaml|sh|sbatch))")
# `X.md, "Title"`, `X.md "Title"`, `X.md, section "Title"` / `section Title` (a quote may be
# escaped inside a Python string).
_SECTION = re.compile(r"((?:[\w.-]+/)*[\w.-]+\.md)[,:]?\s+(?:#\s*)?(?:section\s+)?\\?\"([A-Za-z][^\"\\]*)\\?\"")
_ANCHOR = re.compile(r"(?<![\w/])((?:docs/)?[A-Z]+\.md)#([\w-]+)")


def _tracked(*dirs) -> list[str]:
  out = subprocess.run(["git", "ls-files", *dirs], cwd=ROOT, capture_output=True, text=True,
                       check=True).stdout.split()
  return [f for f in out if (ROOT / f).is_file()]


def _slug(heading: str) -> str:
  """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
  text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
  return text.replace(" ", "-")


def _headings(md: Path) -> list[str]:
  return [l.lstrip("#").strip() for l in md.read_text().splitlines() if re.match(r"#{1,6} ", l)]


def _resolve_md(name: str, where: Path) -> Path | None:
  """The markdown file a reference names: relative to the citing file, the root, or docs/."""
  for base in (where.parent, ROOT, ROOT / "docs"):
    if (base / name).is_file():
      return base / name
  return None


def _dead_references(path: str) -> list[str]:
  file = ROOT / path
  text = file.read_text(errors="replace")
  dead = []
  for n, line in enumerate(text.splitlines(), 1):
    where = f"{path}:{n}"
    if path.endswith(".md"):
      for target in _LINK.findall(line):
        if re.match(r"[a-z]+:", target) or target.startswith("#") and not target[1:]:
          continue  # a URL
        name, _, anchor = target.partition("#")
        md = file if not name else (file.parent / name)
        if not md.exists():
          dead.append(f"{where}: link to {target}: no such file")
        elif anchor and md.suffix == ".md" and anchor not in map(_slug, _headings(md)):
          dead.append(f"{where}: link to {target}: no such section")
    for ref in _PATH.findall(line):
      if not (ROOT / ref).exists() and not (file.parent / ref).exists():
        dead.append(f"{where}: {ref}: no such file")
    for name, anchor in () if path.endswith(".md") else _ANCHOR.findall(line):
      md = _resolve_md(name, file)
      if md is not None and anchor not in map(_slug, _headings(md)):
        dead.append(f"{where}: {name}#{anchor}: no such section")
  for m in _SECTION.finditer(text):  # over the whole text: a citation may wrap a line
    name, title = m.group(1), " ".join(re.sub(r"\n\s*#?", " ", m.group(2)).split())
    where = f"{path}:{text.count(chr(10), 0, m.start()) + 1}"
    md = _resolve_md(name, file)
    if md is None:
      dead.append(f"{where}: {name}: no such file")
    elif not any(h.lower().startswith(title.lower()) for h in _headings(md)):
      dead.append(f'{where}: {name}, "{title}": no such section')
  return dead


def test_every_cross_reference_leads_somewhere():
  files = DOCS + [f for f in _tracked(*CODE_DIRS) if f.endswith((".py", ".sh", ".yaml", ".sbatch"))
                  and f not in OTHER_TREES]
  dead = [d for f in files for d in _dead_references(f)]
  assert not dead, "dead references:\n" + "\n".join(dead)


def test_the_checker_finds_a_dead_reference(tmp_path, monkeypatch):
  """A planted dead path, link, anchor and section title are each reported; live ones are not."""
  monkeypatch.setattr(__import__(__name__), "ROOT", tmp_path)
  (tmp_path / "docs").mkdir()
  (tmp_path / "docs" / "A.md").write_text("# A\n\n## Live part\n")
  (tmp_path / "docs" / "B.md").write_text(
      "[ok](A.md#live-part) [gone](A.md#dead-part) [nofile](C.md)\n"
      'see docs/A.md, "Live part" and docs/A.md, "Dead part"; docs/Z.md; docs/A.md\n')
  dead = _dead_references("docs/B.md")
  assert len(dead) == 4 and all("B.md:" in d for d in dead), dead
  assert any("A.md#dead-part" in d for d in dead) and any('"Dead part"' in d for d in dead)
  assert any("C.md" in d for d in dead) and any("docs/Z.md" in d for d in dead)
