"""The examples in the docstrings run (every module of the package, and the benchmark scripts)."""

from __future__ import annotations

import doctest
import importlib
import pkgutil

import pytest

import accelerate_memsafe

from .bench import DIR, load_benchmark

MODULES = sorted(
    m.name for m in pkgutil.walk_packages(accelerate_memsafe.__path__, "accelerate_memsafe.")
    if not m.name.startswith("accelerate_memsafe.cli.") or m.name.endswith(("launch", "config"))
)


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples_run(name):
    module = importlib.import_module(name)
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert result.failed == 0, f"{result.failed} docstring example(s) failed in {name}"


@pytest.mark.parametrize("script", sorted(p.stem for p in DIR.glob("*.py")))
def test_benchmark_docstring_examples_run(script):
    module = load_benchmark(script)
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert result.failed == 0, f"{result.failed} docstring example(s) failed in benchmarks/{script}.py"
