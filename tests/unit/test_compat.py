"""The private-API module checks the accelerate version it was written against."""

from __future__ import annotations

import pytest

from accelerate_memsafe import _compat


def test_installed_accelerate_is_a_tested_version():
    assert _compat.check_accelerate_version() is True


def test_untested_version_warns():
    with pytest.warns(UserWarning, match="tested with accelerate"):
        assert _compat.check_accelerate_version("9.0.0") is False


def test_fsdp2_prepare_model_reads_only_what_the_view_provides():
    # If accelerate starts reading another accelerator attribute, fsdp2_wrap's view must grow: this test
    # pins the attribute set by inspecting the function's source.
    import inspect
    import re

    from accelerate.utils import fsdp2_prepare_model

    src = inspect.getsource(fsdp2_prepare_model)
    used = set(re.findall(r"accelerator\.(\w+)", src)) | set(re.findall(r"getattr\(accelerator, \"(\w+)\"", src))
    assert used <= {"state", "torch_device_mesh", "parallelism_config", "mixed_precision", "is_main_process", "device"}, used
