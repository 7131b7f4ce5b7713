"""No function in ``dpfsdp_verify/properties/`` is longer than ``MAX_LINES`` lines (issue 35).

A function is measured with ``ast`` as ``end_lineno - lineno + 1``: its ``def`` line to its last line,
docstring included, decorators excluded. A long check or detector is split into named steps (detectors
return findings, ``properties/wording/`` builds their sentences) so each step can be read on its own.
"""
import ast
from pathlib import Path
from typing import List, Tuple

import dpfsdp_verify.properties

MAX_LINES = 60
ROOT = Path(dpfsdp_verify.properties.__file__).parent


def long_functions(source: str, max_lines: int = MAX_LINES) -> List[Tuple[str, int, int]]:
    """``(qualified name, first line, length)`` of every function or method of ``source`` longer than
    ``max_lines`` (nested functions included, named ``outer.inner``)."""
    found: List[Tuple[str, int, int]] = []

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = f"{prefix}{child.name}"
                if not isinstance(child, ast.ClassDef):
                    length = (child.end_lineno or child.lineno) - child.lineno + 1
                    if length > max_lines:
                        found.append((name, child.lineno, length))
                visit(child, f"{name}.")
            else:
                visit(child, prefix)

    visit(ast.parse(source), "")
    return found


def test_the_measure_counts_def_to_last_line_without_decorators():
    body = "\n".join(f"    x{i} = {i}" for i in range(58))
    ok = f"@decorator\ndef f():\n    '''doc'''\n{body}\n"  # def + docstring + 58 lines: 60
    assert long_functions(ok) == []
    too_long = f"class C:\n    def g(self):\n        '''doc'''\n{body.replace('    ', '        ')}\n        y = 1\n"
    assert long_functions(too_long) == [("C.g", 2, 61)]


def test_no_function_in_properties_is_longer_than_60_lines():
    modules = sorted(ROOT.rglob("*.py"))
    assert len(modules) > 10, f"found only {len(modules)} modules under {ROOT}"
    offenders = [f"{path.relative_to(ROOT.parent.parent)}:{line} {name} ({length} lines)"
                 for path in modules for name, line, length in long_functions(path.read_text())]
    assert not offenders, (f"functions longer than {MAX_LINES} lines (split them into named steps):\n  "
                           + "\n  ".join(offenders))
