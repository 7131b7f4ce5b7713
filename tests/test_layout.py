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


#: what a run's state is held in, so a probe of it is a contract nobody wrote down: a pool (the
#: objects the scheduler drives), a progress reporter, a session
RUN_OBJECTS = ("pool", "progress", "reporter", "session")
#: the capabilities a pool declares (``harness/pools.py``: ``JobPool``), never probed for
POOL_CAPABILITIES = ("prestart", "side_lane", "warm_up", "lanes")


def run_state_problems(source: str, where: str = "<source>") -> list:
    """Where ``source`` keeps a run's state out of sight: a context variable (``contextvars``: the
    run's state is a field of its ``Session`` / ``Options``, handed down) or a ``getattr`` /
    ``hasattr`` probe of a pool, progress or session object or of a pool capability (a pool declares
    what it can do: a typed interface). ``where: line: what`` each."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            names = [a.name for a in node.names] + [getattr(node, "module", None) or ""]
            if any(n.split(".")[0] == "contextvars" or n == "ContextVar" for n in names):
                found.append(f"{where}:{node.lineno}: imports contextvars")
        elif isinstance(node, ast.Name) and node.id == "ContextVar":
            found.append(f"{where}:{node.lineno}: ContextVar")
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("getattr", "hasattr")
              and node.args):
            probed = ast.unparse(node.args[0]).lower()
            name = node.args[1].value if len(node.args) > 1 and isinstance(node.args[1], ast.Constant) else ""
            if any(w in probed for w in RUN_OBJECTS) or name in POOL_CAPABILITIES:
                found.append(f"{where}:{node.lineno}: {node.func.id}({ast.unparse(node.args[0])}, {name!r})")
    return found


def test_no_context_variable_and_no_probe_of_a_pool():
    found = [p for path in _modules() for p in run_state_problems(path.read_text(), str(path.relative_to(PKG)))]
    assert found == [], f"a run's state out of sight (a field of the Session, handed down, instead): {found}"


def test_the_run_state_check_sees_a_context_variable_and_a_probe():
    """The check above fails where the package kept its planning switch in a context variable and
    probed the pool for a side lane (as it did before issue 49), and passes the explicit forms."""
    before = ("from contextvars import ContextVar\n_PLANNING: ContextVar[bool] = ContextVar('p', default=False)\n"
              "def lanes(self):\n    return getattr(self.pool, 'side_lane', None)\n"
              "def warm(pool):\n    return hasattr(pool, 'prestart')\n")
    assert [p.split(": ", 1)[1] for p in run_state_problems(before)] == [
        "imports contextvars", "ContextVar", "ContextVar", "getattr(self.pool, 'side_lane')",
        "hasattr(pool, 'prestart')"]
    after = ("def lanes(self):\n    return self.pool.side_lane('explore')\n"
             "def cases(point):\n    return norm_picked(spec, pick, planning=point.planning)\n"
             "def version(mod):\n    return getattr(mod, '__version__', None)\n")
    assert run_state_problems(after) == []
