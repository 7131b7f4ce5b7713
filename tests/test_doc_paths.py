"""Docs that cannot drift: every file path and doc page that the docs, the README and the code's
comments cite exists, and every install line can be run as written.

* A path is a repository-relative path with an extension under one of the repository's folders
  (``docs/gate.md``, ``tests/gate/test_cli.py``, ``dpfsdp_verify/gate/report.py``), anywhere in a
  ``.md`` or ``.py`` file; a markdown link's target is resolved from the page's folder. A pattern
  (``tests/properties/test_<topic>.py``, ``NAME.toml``) is not a path.
* An install line (``pip install ...`` in README.md, CONTRIBUTING.md, docs/ and examples/) never
  names ``dpfsdp-verify`` as a registry package (it is not on one: install from a checkout, ``pip
  install -c constraints.txt -e .``, or a built wheel), and a placeholder URL (``OWNER``) is said
  to be one on its line or the line before.
"""

from __future__ import annotations

import glob
import os
import re
import shutil

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FOLDERS = ("docs", "tests", "dpfsdp_verify", "fixtures", "scripts", "examples", "benchmarks", ".ci")
PATH = re.compile(r"(?<![\w/.\-<])((?:" + "|".join(re.escape(f) for f in FOLDERS)
                  + r")/[\w./\-]*\.(?:py|md|toml|yml|json|txt|sh))\b")
LINK = re.compile(r"\]\(([^)#\s]+\.(?:md|py|yml|toml|json))(?:#[^)]*)?\)")
#: written by a run, not checked in; or another project's file (opacus' own example)
NOT_HERE = ("benchmarks/results.json", "examples/tensor_parallelism_toy.py")
#: a pattern, not a path: ``NAME.toml``, ``test_<topic>.py``
PATTERN = re.compile(r"/[A-Z_]+\.\w+$|<")


def cited_files(root: str):
    return (["README.md", "CONTRIBUTING.md"] + sorted(glob.glob("docs/*.md", root_dir=root))
            + sorted(p for p in glob.glob("**/*.py", root_dir=root, recursive=True)
                     if not p.startswith(("build", ".")) and ".egg-info" not in p))


def stale_references(root: str, files) -> list:
    """``[(file, line, cited path)]`` of every cited path under ``root`` that does not exist."""
    out = []
    for f in files:
        with open(os.path.join(root, f), encoding="utf-8") as fh:
            text = fh.read()
        cited = [(m.start(), m.group(1), os.path.join(root, m.group(1))) for m in PATH.finditer(text)]
        if f.endswith(".md"):
            cited += [(m.start(), m.group(1), os.path.join(root, os.path.dirname(f), m.group(1)))
                      for m in LINK.finditer(text) if "://" not in m.group(1)]
        for at, shown, path in cited:
            if shown in NOT_HERE or PATTERN.search(shown) or os.path.exists(os.path.normpath(path)):
                continue
            out.append((f, text.count("\n", 0, at) + 1, shown))
    return out


def test_every_cited_path_exists():
    stale = stale_references(REPO, cited_files(REPO))
    assert stale == [], "\n".join(f"{f}:{n}: cites {p}, which does not exist" for f, n, p in stale)


def test_a_renamed_page_is_caught(tmp_path):
    for f in ["README.md"] + glob.glob("docs/*.md", root_dir=REPO):
        os.makedirs(tmp_path / os.path.dirname(f), exist_ok=True)
        shutil.copy(os.path.join(REPO, f), tmp_path / f)
    files = ["README.md"] + sorted(glob.glob("docs/*.md", root_dir=tmp_path))
    before = {p for _, _, p in stale_references(str(tmp_path), files)}  # the copy lacks the code
    os.rename(tmp_path / "docs" / "hangs.md", tmp_path / "docs" / "deadlocks.md")
    files = ["README.md"] + sorted(glob.glob("docs/*.md", root_dir=tmp_path))
    stale = [(f, p) for f, _, p in stale_references(str(tmp_path), files) if p not in before]
    assert {p for _, p in stale} == {"hangs.md", "docs/hangs.md"}
    assert ("docs/gate.md", "hangs.md") in stale and ("README.md", "docs/hangs.md") in stale


def test_a_page_gone_from_the_repository_is_caught(monkeypatch):
    """The checker run on the repository itself, with one page made to be missing (``os.path.exists``
    answers no for it; no file is touched): every citation of it, from the docs and the code, fails."""
    gone, real = os.path.normpath(os.path.join(REPO, "docs", "horizon.md")), os.path.exists
    monkeypatch.setattr(os.path, "exists", lambda p: os.path.normpath(p) != gone and real(p))
    stale = {(f, p) for f, _, p in stale_references(REPO, cited_files(REPO))}
    assert stale and {p for _, p in stale} <= {"horizon.md", "docs/horizon.md"}
    assert ("docs/gate.md", "horizon.md") in stale
    assert any(f.endswith(".py") for f, _ in stale)  # a comment in the code cites it too


INSTALL = re.compile(r"pip install [^`\n|]*")
REGISTRY_NAME = re.compile(r"""(?<![\w/.\-@])["']?dpfsdp-verify(?:\[[\w,]+\])?["']?(?=\s|$)(?!\s*@)""")


def install_lines(root: str = REPO):
    files = ["README.md", "CONTRIBUTING.md"] + sorted(glob.glob("docs/*.md", root_dir=root)) + sorted(
        glob.glob("examples/*", root_dir=root))
    for f in files:
        with open(os.path.join(root, f), encoding="utf-8") as fh:
            lines = fh.read().splitlines()
        for i, line in enumerate(lines):
            for m in INSTALL.finditer(line):  # up to a following command (`... && dpfsdp-verify run`)
                yield f"{f}:{i + 1}", m.group(0).split("&&")[0], (lines[i - 1] if i else "") + " " + line


def test_install_lines_can_be_run_as_written():
    found = list(install_lines())
    assert len(found) >= 5
    bad = [(where, cmd) for where, cmd, _ in found if REGISTRY_NAME.search(cmd)]
    assert bad == [], f"installs dpfsdp-verify from a registry it is not on: {bad}"
    placeholders = [(where, cmd) for where, cmd, context in found
                    if "OWNER" in cmd and not re.search(r"placeholder|REPLACE", context, re.I)]
    assert placeholders == [], f"a placeholder URL not said to be one: {placeholders}"
