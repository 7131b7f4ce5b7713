"""Every option default the docs quote is the code's: a page saying ``--explore SECONDS`` (default 8)
while the CLI's default is 6 is a page a user acts on wrongly. The code's default of an option is
its parser default where it has one, else the number its ``--help`` states (built from
``config/defaults.py``); the docs' is the number after "default" following the option in
backticks, in the same sentence."""

from __future__ import annotations

import argparse
import glob
import os
import re

from dpfsdp_verify.gate.cli import build_parser

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
NUMBER = r"-?\d+(?:\.\d+)?"
#: ``--option ARG`` in backticks, then (in the same sentence, before the next backtick) "default N"
QUOTED = re.compile(r"`(--[a-z][a-z-]*)[^`]*`([^`.]*?)\bdefault:? (" + NUMBER + r")\b")


def _numeric(value) -> "float | None":
    if isinstance(value, bool) or value is None:
        return None
    if isinstance(value, (int, float)):
        return float(value)
    return float(value) if isinstance(value, str) and re.fullmatch(NUMBER, value) else None


def code_defaults() -> dict:
    """``{(subcommand, option): numeric default}`` for every option of every subcommand."""
    out = {}
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    for name, sp in sub.choices.items():
        for action in sp._actions:
            if not action.option_strings:
                continue
            stated = re.search(r"default:? (" + NUMBER + r")\b", action.help or "")
            value = _numeric(action.default)
            if value is None and stated:
                value = float(stated.group(1))
            if value is not None:
                out[(name, action.option_strings[-1])] = value
    return out


def doc_quotes(text: str):
    """``(option, quoted default)`` for every default the text quotes for an option."""
    for m in QUOTED.finditer(text):
        yield m.group(1), float(m.group(3))


def _pages():
    return [os.path.join(REPO, "README.md")] + sorted(glob.glob(os.path.join(REPO, "docs", "*.md")))


def test_every_default_the_docs_quote_is_the_codes():
    code = code_defaults()
    by_option: dict = {}
    for (_cmd, opt), value in code.items():
        by_option.setdefault(opt, set()).add(value)
    wrong, seen = [], 0
    for page in _pages():
        for opt, quoted in doc_quotes(open(page).read()):
            if opt not in by_option:
                continue  # an option without a numeric default (or another tool's)
            seen += 1
            if quoted not in by_option[opt]:
                wrong.append(f"{os.path.relpath(page, REPO)}: {opt} default {quoted:g}, the code's "
                             f"{' or '.join(f'{v:g}' for v in sorted(by_option[opt]))}")
    assert seen >= 5, f"the docs quote only {seen} option defaults: the pattern no longer matches them"
    assert wrong == [], "\n".join(wrong)


def test_a_wrong_quoted_default_is_caught():
    code = code_defaults()
    assert code[("run", "--timeout")] == 60.0
    quotes = dict(doc_quotes("- `--timeout`: deadline per distributed job, seconds (default 61). A deadlock"))
    assert quotes == {"--timeout": 61.0} and quotes["--timeout"] != code[("run", "--timeout")]
