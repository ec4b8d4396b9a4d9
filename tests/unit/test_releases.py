"""The release probes of ``tests/releases.py`` against the installed accelerate: each behaviour came with 1.15, so on
a supported release (1.14 or 1.15, ``_compat.TESTED_ACCELERATE``) every probe answers as the release does. A source
probe that no longer finds its text (accelerate rewords a message, moves a check) fails here rather than turning the
tests that ask it into quiet skips or the older release's expectations."""

from __future__ import annotations

import accelerate
import pytest
from packaging.version import Version

from accelerate_memsafe import _compat
from tests import releases

PROBES = [releases.accelerate_refuses_context_parallel_layer_types, releases.stock_reloads_a_full_state_dict_adapter,
          releases.accelerate_groups_a_tied_head_with_its_embedding, releases.accelerate_offloads_checkpointed_activations]


@pytest.mark.parametrize("probe", PROBES, ids=lambda p: p.__name__)
def test_each_release_probe_answers_as_the_installed_release(probe):
    installed = Version(accelerate.__version__)
    low, high = _compat.TESTED_ACCELERATE
    if not low <= installed < high:
        pytest.skip(f"accelerate {installed} is not a tested release (>={low},<{high}): its probes are not checked")
    assert probe() is (installed >= Version("1.15")), f"{probe.__name__} on accelerate {installed}"
