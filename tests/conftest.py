"""Shared fixtures: every test leaves no process group and no accelerate state behind."""

from __future__ import annotations

import os
import re

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def _slow_wanted(config) -> bool:
    """``@pytest.mark.slow`` tests (the long cells of a matrix whose reduced set runs by default) run with
    ``MEMSAFE_SLOW=1`` or ``-m slow``."""
    selected = re.search(r"(?<!not )\bslow\b", config.getoption("markexpr", default="") or "")
    return bool(os.environ.get("MEMSAFE_SLOW") == "1" or selected)


def pytest_collection_modifyitems(config, items):
    slow = None if _slow_wanted(config) else pytest.mark.skip(reason="a long cell: set MEMSAFE_SLOW=1, or pass -m slow")
    gpu = None if _has_cuda() else pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if gpu is not None and "gpu" in item.keywords:
            item.add_marker(gpu)
        if slow is not None and item.get_closest_marker("slow"):
            item.add_marker(slow)


@pytest.fixture(autouse=True)
def _teardown_distributed():
    yield
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    try:
        from accelerate.state import AcceleratorState, GradientState

        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()
    except Exception:
        pass
    for key in [k for k in os.environ if k.startswith("ACCELERATE_MEMSAFE_")]:
        del os.environ[key]


@pytest.fixture
def tiny_llama_dir(tmp_path_factory):
    """A tiny random Llama checkpoint saved with save_pretrained (safetensors)."""
    from accelerate_memsafe.models import save_llama

    return save_llama(tmp_path_factory.mktemp("tiny-llama"), "tiny")
