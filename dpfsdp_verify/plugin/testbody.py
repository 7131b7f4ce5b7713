"""Rank side of the pytest plugin's pool mode: find the test function on a rank and run it.

A test module is imported on a rank the way pytest imports it in the parent: through pytest's
assertion rewriting (``_pytest.assertion.rewrite.rewrite_asserts``), so a failing
``assert x == y`` on a rank reports the values (``assert [1, 2, 3] == [1, 2, 4]``), not a bare
``AssertionError``.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import sys
from dataclasses import dataclass
from importlib.machinery import ModuleSpec
from typing import Optional, cast


def _import_rewritten(name: str, path: str):
    """Import the module ``name`` from the source file ``path`` with pytest's assertion
    rewriting; returns the module (registered in ``sys.modules``). Raises ``ImportError`` when the
    file cannot be read, ``SyntaxError`` when it does not parse."""
    from _pytest.assertion.rewrite import rewrite_asserts

    try:
        with open(path, "rb") as f:
            source = f.read()
    except OSError as e:
        raise ImportError(f"cannot read test module {path}: {e}") from e
    if "." in name:  # a package's test module: its package first, for relative imports
        importlib.import_module(name.rpartition(".")[0])
    tree = ast.parse(source, filename=path)
    rewrite_asserts(tree, source, path)
    code = compile(tree, path, "exec", dont_inherit=True)
    # a spec for a file location is never None (only a loader-less name is)
    spec = cast(ModuleSpec, importlib.util.spec_from_file_location(name, path))
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    try:
        exec(code, mod.__dict__)
    except BaseException:
        sys.modules.pop(name, None)
        raise
    return mod


@dataclass(frozen=True)
class FunctionRef:
    """A test function (or class) by location, resolvable on a rank whatever pytest's import
    mode was."""

    module: str
    path: str
    qualname: str

    def resolve(self):
        """The function or class object; imports its module on first use (rewritten, when its
        source file is known). Raises ``ImportError`` / ``AttributeError`` if it is not there."""
        mod = sys.modules.get(self.module)
        if mod is None:
            if self.path.endswith(".py"):
                mod = _import_rewritten(self.module, self.path)
            else:
                mod = importlib.import_module(self.module)
        obj = mod
        for part in self.qualname.split("."):
            obj = getattr(obj, part)
        return getattr(obj, "__func__", obj)


def run_test_body(ref: FunctionRef, kwargs: dict, cls_ref: Optional[FunctionRef] = None):
    """Rank-side job: call the test function with this rank's ``rank``/``world_size``; returns
    what the test returns (raises what it raises)."""
    import torch.distributed as dist

    fn = ref.resolve()
    call = dict(kwargs)
    if "rank" in call:
        call["rank"] = dist.get_rank()
    if "world_size" in call:
        call["world_size"] = dist.get_world_size()
    if cls_ref is not None:
        return fn(cls_ref.resolve()(), **call)
    return fn(**call)


__all__ = ["FunctionRef", "run_test_body"]
