"""Loads a script of ``benchmarks/`` as a module, for the tests of its pure functions (the scripts import their
siblings, so their folder is on ``sys.path`` while one loads)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

DIR = Path(__file__).resolve().parents[2] / "benchmarks"


def load_benchmark(script: str):
    """``benchmarks/<script>.py`` as a module named ``<script>_bench``."""
    sys.path.insert(0, str(DIR))
    try:
        spec = importlib.util.spec_from_file_location(f"{script}_bench", DIR / f"{script}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module  # where a dataclass of the script looks its module up
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(str(DIR))
