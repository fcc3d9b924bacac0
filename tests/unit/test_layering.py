"""The layering of the packages: broker is the core, its pure modules do no I/O."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BROKER = ROOT / "broker"
PURE = [
    "envelope",
    "direct_lane",
    "slots",
    "cluster_map",
    "stages",
    "keyspace",
    "ids",
    "routing",
    "ranking",
    "candidates",
    "routing_types",
    "intent",
    "acl",
    "acl_commands",
    "config",
    "redis_url",
    "redaction",
    "governance",
    "usage",
    "budgets",
    "subscriptions",
    "gc_tuning",
    "events",
    "records",
    "errors",
    "failpoints",
    "health",
    "limiter",
    "fairness",
    "retry",
    "durations",
    "durability",
    "results",
    "webhooks",
    "broadcast",
    "headers",
    "entries",
    "deadletters",
    "jsondepth",
    "wire",
    "recovery",
    "record_codec",
    "metric_fields",
    "scripts",
    "timekeeping",
]
IO_LIBRARIES = {"redis", "httpx", "anyio"}
PACKAGES = ["broker", "workers", "adapters"]


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(path: Path) -> set[str]:
    """Absolute names of every module ``path`` imports, relative imports resolved."""
    package = module_name(path).split(".")
    if path.name != "__init__.py":
        package = package[:-1]
    return imports_of(path.read_text(encoding="utf-8"), package)


def imports_of(source: str, package: list[str]) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - node.level + 1]
                module = ".".join([*base, node.module] if node.module else base)
            else:
                module = node.module or ""
            names.add(module)
            # `from . import x` and `from pkg import sub` may name submodules.
            names.update(".".join(filter(None, [module, alias.name])) for alias in node.names)
    return names


def top_levels(names: set[str]) -> set[str]:
    return {name.split(".")[0] for name in names}


def test_the_import_walker_sees_relative_and_absolute_imports() -> None:
    names = imported_modules(BROKER / "routing.py")
    assert "broker.candidates" in names
    assert "collections.abc" in names
    source = (
        "import redis.asyncio as r\n"
        "from ..workers import cli\n"
        "from .. import adapters\n"
        "def f():\n    import httpx\n"
    )
    assert top_levels(imports_of(source, ["broker"])) >= {"redis", "workers", "adapters", "httpx"}
    assert imports_of("from .stages import Stage", ["broker"]) == {
        "broker.stages",
        "broker.stages.Stage",
    }


BROKER_FILES = sorted(BROKER.rglob("*.py"))


def test_broker_has_modules() -> None:
    assert len(BROKER_FILES) > 10


@pytest.mark.parametrize("path", BROKER_FILES, ids=lambda p: p.name)
def test_broker_imports_nothing_from_workers_or_adapters(path: Path) -> None:
    assert not top_levels(imported_modules(path)) & {"workers", "adapters"}


@pytest.mark.parametrize("name", PURE)
def test_pure_modules_import_no_io_library(name: str) -> None:
    names = imported_modules(BROKER / f"{name}.py")
    assert not top_levels(names) & IO_LIBRARIES


@pytest.mark.parametrize("name", PURE)
def test_pure_modules_import_only_pure_broker_modules(name: str) -> None:
    names = imported_modules(BROKER / f"{name}.py")
    inside = {n.split(".")[1] for n in names if n.startswith("broker.") and n.count(".") >= 1}
    assert inside <= set(PURE), inside - set(PURE)


@pytest.mark.parametrize("package", PACKAGES)
def test_package_all_resolves(package: str) -> None:
    module = importlib.import_module(package)
    exported = module.__all__
    assert exported
    assert len(set(exported)) == len(exported), "duplicates in __all__"
    for name in exported:
        assert getattr(module, name) is not None, name


def _ruf022_key(name: str) -> tuple[int, str]:
    if name.isupper():
        return 0, name
    if name[:1].isupper():
        return 1, name
    return 2, name


@pytest.mark.parametrize("package", PACKAGES)
def test_package_all_is_sorted(package: str) -> None:
    exported = list(importlib.import_module(package).__all__)
    assert exported == sorted(exported, key=_ruf022_key)
