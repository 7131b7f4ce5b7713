"""The package's layout rules, as tests (CONTRIBUTING.md, "Layout"): few modules at the package
root (the rest live in packages by concern), no module too long to read, and no private name read
across packages (a package's ``_name`` is its own business; another package reading it is a
contract nobody wrote down)."""

from __future__ import annotations

import ast
import pathlib

import dpfsdp_verify

PKG = pathlib.Path(dpfsdp_verify.__file__).parent
#: the root keeps at most this many modules (``__init__`` and ``__main__`` included)
MAX_ROOT_MODULES = 8
#: no module is longer than this many lines
MAX_MODULE_LINES = 650


def _modules():
    return sorted(p for p in PKG.rglob("*.py") if "__pycache__" not in p.parts)


def _package_of(path: pathlib.Path) -> str:
    """The top-level package a module belongs to (``gate``, ``properties``, ...); ``""`` at the root."""
    rel = path.relative_to(PKG).parts
    return rel[0] if len(rel) > 1 else ""


def test_root_holds_few_modules():
    root = sorted(p.name for p in PKG.glob("*.py"))
    assert len(root) <= MAX_ROOT_MODULES, f"{len(root)} modules at the package root: {root}"


def test_no_module_is_too_long():
    long = {str(p.relative_to(PKG)): n for p in _modules() if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES}
    assert long == {}, f"modules over {MAX_MODULE_LINES} lines (split by concern): {long}"


def _imported_from_other_packages(path: pathlib.Path, tree: ast.AST):
    """``{local name: source module}`` for names this module imports from another top-level package."""
    own = _package_of(path)
    depth = len(path.relative_to(PKG).parts) - 1
    out = {}
    for node in ast.walk(tree):
        if not isinstance(node, ast.ImportFrom):
            continue
        if node.level:
            if node.level <= depth:  # stays inside this module's own top-level package
                continue
            target = (node.module or "").split(".")[0]
        elif (node.module or "").startswith("dpfsdp_verify."):
            target = node.module.split(".")[1]
        else:
            continue
        if target == own:
            continue
        for alias in node.names:
            out[alias.asname or alias.name] = f"{target}:{alias.name}"
    return out


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def test_no_private_name_is_read_across_packages():
    offenders = []
    for path in _modules():
        tree = ast.parse(path.read_text())
        imported = _imported_from_other_packages(path, tree)
        rel = str(path.relative_to(PKG))
        for source in imported.values():
            if _private(source.split(":")[1]):
                offenders.append(f"{rel}: imports {source}")
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and _private(node.attr) and isinstance(node.value, ast.Name)
                    and node.value.id in imported):
                offenders.append(f"{rel}:{node.lineno}: reads {node.value.id}.{node.attr} ({imported[node.value.id]})")
    assert offenders == [], "private names read across packages:\n" + "\n".join(offenders)
