"""Shared fixtures: every test leaves no process group and no accelerate state behind."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def pytest_collection_modifyitems(config, items):
    if _has_cuda():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


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
