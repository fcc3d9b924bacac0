"""The shape of the code: module, class and function sizes, and where rules are defined.

    python -m bench.code_shape

Measured with ``ast`` over ``broker/``, ``adapters/`` and ``workers/``. Prints the largest
modules, classes and functions, the places that import ``redis.exceptions`` and the places
that define a group of stages (a module-level ``frozenset`` of ``Stage`` members).
``tests/unit/test_code_shape.py`` holds the limits.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("broker", "adapters", "workers")
MAX_FUNCTION_LINES = 60
MAX_MODULE_LINES = 450
MAX_CLASS_METHODS = 25
_FUNCTIONS = (ast.FunctionDef, ast.AsyncFunctionDef)


@dataclass
class Shape:
    modules: dict[str, int] = field(default_factory=dict)  # path -> lines
    classes: dict[str, int] = field(default_factory=dict)  # path:Class -> methods
    functions: dict[str, int] = field(default_factory=dict)  # path:name -> lines
    redis_exception_imports: list[str] = field(default_factory=list)
    stage_groups: list[str] = field(default_factory=list)  # path:NAME


def measure(root: Path = ROOT) -> Shape:
    shape = Shape()
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            _measure_module(shape, path.relative_to(root).as_posix(), path.read_text())
    return shape


def _measure_module(shape: Shape, name: str, source: str) -> None:
    tree = ast.parse(source)
    shape.modules[name] = len(source.splitlines())
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef):
            methods = [n for n in node.body if isinstance(n, _FUNCTIONS)]
            shape.classes[f"{name}:{node.name}"] = len(methods)
        elif isinstance(node, _FUNCTIONS):
            assert node.end_lineno is not None
            first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
            shape.functions[f"{name}:{node.name}"] = node.end_lineno - first + 1
        elif isinstance(node, ast.ImportFrom | ast.Import) and _imports_redis_exceptions(node):
            shape.redis_exception_imports.append(name)
    for node in tree.body:
        target, value = _assignment(node)
        if target and value is not None and _is_stage_group(value):
            shape.stage_groups.append(f"{name}:{target}")


def _imports_redis_exceptions(node: ast.Import | ast.ImportFrom) -> bool:
    if isinstance(node, ast.ImportFrom):
        return (node.module or "").startswith("redis.exceptions") or (
            node.module == "redis" and any(a.name == "exceptions" for a in node.names)
        )
    return any(a.name.startswith("redis.exceptions") for a in node.names)


def _assignment(node: ast.stmt) -> tuple[str, ast.expr | None]:
    if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name):
        return node.targets[0].id, node.value
    if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
        return node.target.id, node.value
    return "", None


def _is_stage_group(value: ast.expr) -> bool:
    """``frozenset({Stage.A, ...})`` or a ``|`` of such sets and names of groups."""
    if isinstance(value, ast.BinOp):
        return _is_stage_group(value.left) or _is_stage_group(value.right)
    if not (isinstance(value, ast.Call) and getattr(value.func, "id", "") == "frozenset"):
        return False
    return any(
        isinstance(n, ast.Attribute) and getattr(n.value, "id", "") == "Stage"
        for arg in value.args
        for n in ast.walk(arg)
    )


def _top(counts: dict[str, int], n: int) -> list[tuple[str, int]]:
    return sorted(counts.items(), key=lambda kv: -kv[1])[:n]


def main() -> None:
    shape = measure()
    functions = sorted(shape.functions.values())
    print(f"modules {len(shape.modules)}, classes {len(shape.classes)}, functions {len(functions)}")
    print(f"function lines: p50 {functions[len(functions) // 2]}, max {functions[-1]}")
    for title, counts in (
        ("largest modules (lines)", shape.modules),
        ("classes with most methods", shape.classes),
        ("longest functions (lines)", shape.functions),
    ):
        print(title + ":")
        for name, value in _top(counts, 5):
            print(f"  {value:5d}  {name}")
    print(f"places importing redis.exceptions: {len(shape.redis_exception_imports)}")
    files = sorted({g.split(":")[0] for g in shape.stage_groups})
    print(f"stage groups defined: {len(shape.stage_groups)}, in {len(files)} file(s): {files}")


if __name__ == "__main__":
    main()
