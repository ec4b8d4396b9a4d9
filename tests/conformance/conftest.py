"""The full matrix (``@pytest.mark.conformance``) is skipped unless asked for: ``MEMSAFE_CONFORMANCE=1``,
``-m conformance``, or ``--conformance`` (that option exists when pytest starts in ``tests/conformance``)."""

from __future__ import annotations

import os
import re

import pytest


def pytest_addoption(parser):
    parser.addoption("--conformance", action="store_true", help="run the full conformance matrix (tests/conformance)")


def _wanted(config) -> bool:
    selected = re.search(r"(?<!not )\bconformance\b", config.getoption("markexpr", default="") or "")
    return bool(config.getoption("--conformance", default=False) or os.environ.get("MEMSAFE_CONFORMANCE") == "1" or selected)


def pytest_collection_modifyitems(config, items):
    if _wanted(config):
        return
    skip = pytest.mark.skip(reason="the full conformance matrix: set MEMSAFE_CONFORMANCE=1, or pass -m conformance")
    for item in items:
        if item.get_closest_marker("conformance"):
            item.add_marker(skip)
