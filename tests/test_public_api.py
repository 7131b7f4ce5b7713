"""The public API is declared (``__all__`` in every public module, each name real) and what the
docs and examples show a user stays on it: a name the docs teach that a module does not export,
or an example importing an internal module, is an API break waiting to happen."""

from __future__ import annotations

import ast
import glob
import importlib
import os
import re

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

#: the public modules ``dpfsdp_verify/__init__.py`` lists
PUBLIC = ["dpfsdp_verify", "dpfsdp_verify.reference", "dpfsdp_verify.models", "dpfsdp_verify.harness",
          "dpfsdp_verify.targets", "dpfsdp_verify.targets.base", "dpfsdp_verify.targets.util",
          "dpfsdp_verify.targets.progress", "dpfsdp_verify.properties", "dpfsdp_verify.properties.analysis.compare",
          "dpfsdp_verify.strategies", "dpfsdp_verify.fuzz", "dpfsdp_verify.config.hypothesis_profiles",
          "dpfsdp_verify.verdict", "dpfsdp_verify.errors", "dpfsdp_verify.config.defaults"]


@pytest.mark.parametrize("name", PUBLIC)
def test_every_public_module_declares_real_names(name):
    module = importlib.import_module(name)
    assert isinstance(getattr(module, "__all__", None), list), f"{name} has no __all__"
    missing = [n for n in module.__all__ if not hasattr(module, n)]
    assert missing == [], f"{name}.__all__ names what it does not define: {missing}"
    assert len(set(module.__all__)) == len(module.__all__), f"{name}.__all__ repeats a name"


def _python_blocks(text: str):
    return re.findall(r"```python\n(.*?)```", text, re.S)


def _imports(code: str):
    """``(module, name)`` for every ``from dpfsdp_verify... import name`` in ``code``."""
    for node in ast.walk(ast.parse(code)):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("dpfsdp_verify"):
            for alias in node.names:
                yield node.module, alias.name


def test_docs_and_examples_import_only_public_names():
    sources = {os.path.relpath(p, REPO): open(p).read()
               for p in [os.path.join(REPO, "README.md"), os.path.join(REPO, "CONTRIBUTING.md")]
               + glob.glob(os.path.join(REPO, "docs", "*.md"))}
    code = {f"{path} block {i}": block for path, text in sources.items()
            for i, block in enumerate(_python_blocks(text))}
    code.update({os.path.relpath(p, REPO): open(p).read() for p in glob.glob(os.path.join(REPO, "examples", "*.py"))})
    seen, offenders = 0, []
    for where, src in code.items():
        for module, name in _imports(src):
            seen += 1
            full = f"{module}.{name}"
            if full in PUBLIC:
                continue  # a public submodule
            if module not in PUBLIC:
                offenders.append(f"{where}: imports from internal module {module}")
            elif name not in importlib.import_module(module).__all__:
                offenders.append(f"{where}: {module}.{name} is not in its __all__")
    assert seen >= 5, "the docs' examples import the package: this test must see them"
    assert offenders == []
