"""The code keeps its shape: small modules, classes and functions; rules in one place."""

from __future__ import annotations

from bench.code_shape import (
    MAX_CLASS_METHODS,
    MAX_FUNCTION_LINES,
    MAX_MODULE_LINES,
    Shape,
    _measure_module,
    measure,
)

SHAPE = measure()


def test_no_module_is_too_long() -> None:
    assert {m: n for m, n in SHAPE.modules.items() if n > MAX_MODULE_LINES} == {}


def test_no_class_has_too_many_methods() -> None:
    assert {c: n for c, n in SHAPE.classes.items() if n > MAX_CLASS_METHODS} == {}


def test_no_function_is_too_long() -> None:
    assert {f: n for f, n in SHAPE.functions.items() if n > MAX_FUNCTION_LINES} == {}


def test_nothing_imports_redis_exceptions() -> None:
    assert SHAPE.redis_exception_imports == []


def test_every_stage_group_is_defined_in_stages() -> None:
    assert SHAPE.stage_groups, "the measure finds the groups in broker/stages.py"
    assert {g.split(":")[0] for g in SHAPE.stage_groups} == {"broker/stages.py"}


def test_the_measure_sees_what_it_counts() -> None:
    shape = Shape()
    source = (
        "from redis.exceptions import ResponseError\n"
        "LIVE = frozenset({Stage.WAITING}) | OTHER\n"
        "class A:\n    def f(self):\n        pass\n    async def g(self):\n        pass\n"
    )
    _measure_module(shape, "x.py", source)
    assert shape.modules == {"x.py": 7}
    assert shape.classes == {"x.py:A": 2}
    assert shape.functions == {"x.py:f": 2, "x.py:g": 2}
    assert shape.redis_exception_imports == ["x.py"]
    assert shape.stage_groups == ["x.py:LIVE"]
