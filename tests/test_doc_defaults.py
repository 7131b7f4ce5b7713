"""Docs that cannot drift, part 2: every option default the docs quote equals the code's.

A quote is an option in backticks (`` `--explore DRAWS` ``) followed, in the same clause (before the
next option, a full stop, a semicolon or a blank line), by ``default N`` / ``defaults to N`` /
``default: N`` with N a number (``8 x world size``, an expression, is not a quote). The code's default
is the ``dpfsdp-verify`` parser's (``gate/cli.py``: ``build_parser``) for the subcommand the page is
about (docs/scale.md: ``scale``; every other page: ``run``), or -- where the parser leaves ``None``
for the run to fill in -- what a plain ``dpfsdp-verify run`` resolves it to (``RunPlan.from_args``)
or the property that owns the option declares (``RESOLVED``). A quote of an option the code has no
default for fails too, so a renamed option cannot keep a quoted default.
"""

from __future__ import annotations

import argparse
import glob
import os
import re

import pytest

from dpfsdp_verify.config.defaults import EXPLORE_ENV, POISSON_DEFAULTS
from dpfsdp_verify.gate import cli
from dpfsdp_verify.gate.plan import RunPlan
from dpfsdp_verify.properties import PROPERTIES

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OPTION = re.compile(r"`(--[a-z][a-z0-9-]*)")
QUOTE = re.compile(r"\bdefaults?(?: to| is|:|=)?\s+`?(\d+(?:\.\d+)?)`?(?!\s*x\b)")
#: where a clause ends: the next option, a full stop, a semicolon, a blank line
CLAUSE_END = re.compile(r"`--|\.\s|;\s|\n\s*\n")
#: the pages about a subcommand other than ``run``
SUBCOMMAND_OF = {"docs/scale.md": "scale"}


def _param(pid: str, name: str):
    return lambda plan: dict(PROPERTIES[pid].params)[name]


#: options the parser leaves ``None`` and the run fills in: what a plain run resolves them to
RESOLVED = {
    "--explore": lambda plan: plan.explore,
    "--explore-cap": lambda plan: plan.explore_cap,
    "--wide-world-size": lambda plan: plan.options.wide_world_size,
    "--node-world-size": lambda plan: plan.options.node_world_size,
    "--horizon": lambda plan: plan.options.horizon,
    "--world-sizes": lambda plan: ",".join(map(str, plan.options.world_sizes)),
    "--sample-rate": lambda plan: POISSON_DEFAULTS[0],
    "--audit-canaries": _param("privacy_audit", "audit_canaries"),
    "--audit-steps": _param("privacy_audit", "audit_steps"),
    "--resume-at": _param("checkpoint_resume", "resume_at"),
}


def doc_files(root: str = REPO):
    return ["README.md", "CONTRIBUTING.md"] + sorted(glob.glob("docs/*.md", root_dir=root))


def quoted_defaults(root: str, files):
    """``[(file, line, option, quoted value)]`` of every default the docs quote (module docstring)."""
    out = []
    for f in files:
        with open(os.path.join(root, f), encoding="utf-8") as fh:
            text = fh.read()
        for m in OPTION.finditer(text):
            rest = text[m.end():m.end() + 200]
            end = CLAUSE_END.search(rest)
            quote = QUOTE.search(rest[:end.start()] if end else rest)
            if quote:
                out.append((f, text.count("\n", 0, m.start()) + 1, m.group(1), quote.group(1)))
    return out


def _parser_defaults():
    """``{subcommand: {option: default}}`` of ``build_parser()``."""
    parser = cli.build_parser()
    subs = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return {name: {opt: a.default for a in sub._actions for opt in a.option_strings}
            for name, sub in subs.choices.items()}


def code_default(option: str, subcommand: str, parsers: dict, plan: RunPlan):
    """The code's default of ``option`` (module docstring), or ``None`` when it has none."""
    default = parsers.get(subcommand, {}).get(option)
    if default is None and subcommand == "run" and option in RESOLVED:
        default = RESOLVED[option](plan)
    return default


def _same(quoted: str, default) -> bool:
    if isinstance(default, (int, float)) and not isinstance(default, bool):
        return float(quoted) == float(default)
    return str(default) == quoted


def wrong_defaults(root: str, files, parsers: dict, plan: RunPlan):
    """``[(file, line, option, quoted, code's)]`` of every quoted default that is not the code's."""
    out = []
    for f, line, option, quoted in quoted_defaults(root, files):
        default = code_default(option, SUBCOMMAND_OF.get(f, "run"), parsers, plan)
        if default is None or not _same(quoted, default):
            out.append((f, line, option, quoted, default))
    return out


@pytest.fixture(scope="module")
def plain_run():
    """What ``dpfsdp-verify run`` alone resolves (the package's own tests set ``EXPLORE_ENV``: not here)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv(EXPLORE_ENV, raising=False)
        return RunPlan.from_args(cli.build_parser().parse_args(["run"]), load_target=False)


def test_every_quoted_default_is_the_codes(plain_run):
    quotes = quoted_defaults(REPO, doc_files())
    assert len(quotes) >= 15  # the check reads the docs' quotes at all (16 when written)
    wrong = wrong_defaults(REPO, doc_files(), _parser_defaults(), plain_run)
    assert wrong == [], "\n".join(f"{f}:{n}: quotes {o} default {q}; the code's is {d}" for f, n, o, q, d in wrong)


def test_a_wrong_quoted_default_is_caught(tmp_path, plain_run):
    """docs/gate.md once said ``--explore`` defaulted to 8 s; the code's was 6 s: such a page fails."""
    for f in doc_files():
        os.makedirs(tmp_path / os.path.dirname(f), exist_ok=True)
        with open(os.path.join(REPO, f), encoding="utf-8") as fh:
            (tmp_path / f).write_text(fh.read())
    page = tmp_path / "docs" / "gate.md"
    text = page.read_text()
    assert "`--horizon STEPS` (default 72" in text
    page.write_text(text.replace("`--horizon STEPS` (default 72", "`--horizon STEPS` (default 80"))
    docs = tmp_path / "docs" / "scale.md"
    docs.write_text(docs.read_text().replace("default 1000", "defaults to 500"))
    wrong = wrong_defaults(str(tmp_path), doc_files(str(tmp_path)), _parser_defaults(), plain_run)
    assert [(f, o, q, d) for f, _, o, q, d in wrong] == [("docs/gate.md", "--horizon", "80", 72),
                                                        ("docs/scale.md", "--steps", "500", 1000)]


def test_a_quoted_default_of_a_renamed_option_is_caught(plain_run):
    """An option renamed in the parser (``--horizon`` -> ``--long-steps``): its quoted default has
    no code default left, and the quote fails."""
    parsers = _parser_defaults()
    parsers["run"]["--long-steps"] = parsers["run"].pop("--horizon")
    resolved = dict(RESOLVED)
    del RESOLVED["--horizon"]
    try:
        wrong = wrong_defaults(REPO, doc_files(), parsers, plain_run)
    finally:
        RESOLVED.update(resolved)
    assert {(f, o, d) for f, _, o, _, d in wrong} == {("docs/gate.md", "--horizon", None),
                                                     ("docs/horizon.md", "--horizon", None)}
