"""The project's own rules, checked by the suite so CI enforces them: ruff and mypy --strict."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent


def run(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=240, check=False)


def test_ruff_lints_clean() -> None:
    done = run(str(BIN / "ruff"), "check", ".")
    assert done.returncode == 0, done.stdout + done.stderr


def test_ruff_format_is_applied() -> None:
    done = run(str(BIN / "ruff"), "format", "--check", ".")
    assert done.returncode == 0, done.stdout + done.stderr


def test_mypy_strict_on_broker_adapters_and_workers() -> None:
    done = run(str(BIN / "mypy"))  # packages and strictness come from pyproject.toml
    assert done.returncode == 0, done.stdout + done.stderr
