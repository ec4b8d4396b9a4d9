"""What the installed releases do, where a test's expectation depends on it: one named probe per behaviour.

The package supports accelerate 1.14 and 1.15 (``pyproject.toml``, ``_compat.TESTED_ACCELERATE``), and stock
accelerate differs between them in what the differential tests compare against; torch from 2.8 on, and before 2.11
torch records no file offsets for the optimizer reload (:func:`torch_records_meta_offsets`). A test asks the probe named for the
behaviour, never a version of its own, so that one place says how each behaviour is detected: by what the installed
source does where that is one call to read (the behaviour, not a number a backport could move), by the release
otherwise. ``tests/other_accelerate.sh 1.14.0`` runs the suite against the other release, and
``tests/unit/test_releases.py`` checks that every probe still sees its behaviour where the release has it (a source
probe that stopped matching would otherwise skip its tests quietly).
"""

from __future__ import annotations

import inspect


def accelerate_refuses_context_parallel_layer_types() -> bool:
    """Whether accelerate's ``prepare`` refuses, under context parallelism, a model with a layer that is not full causal
    attention (sliding window, ...) first thing (1.15 on). Before, it attaches its hooks and refuses nothing, and the
    plugin, which asks accelerate's own check (``_compat.context_parallel_refusal``), refuses nothing either."""
    from accelerate.big_modeling import _attach_context_parallel_hooks

    source = inspect.getsource(_attach_context_parallel_hooks)
    # 1.15 reads the config's layer types itself; 1.16 asks transformers' `supports_context_parallel`, which does
    return "does not support attention layers" in source or "supports_context_parallel" in source


def stock_reloads_a_full_state_dict_adapter() -> bool:
    """Whether stock accelerate can reload a PEFT adapter under FSDP2 ``FULL_STATE_DICT`` (the Trainer's
    ``load_best_model_at_end`` and resume; 1.15 on). Before, its ``_set_model_state_dict`` hands peft the empty state
    dict it gives every rank but rank 0, and peft's ``set_peft_model_state_dict`` raises ``KeyError`` on those ranks, so
    the stock Trainer cannot finish such a run; the plugin's CPU-first reload reads the adapter files on every rank."""
    from accelerate.utils import fsdp_utils

    return "full_state_dict" in inspect.getsource(fsdp_utils._set_model_state_dict)


def accelerate_groups_a_tied_head_with_its_embedding() -> bool:
    """Whether accelerate's FSDP2 wrapping puts a tied LM head in the same group as its input embedding (1.15 on).
    1.14 groups the head with the final norm, apart from the embedding that holds the same parameter, and torch 2.13
    refuses a parameter two FSDP groups see (``already managed by another FSDP group``): stock fails there, in every
    wrap setting. The change is a few lines inside ``fsdp2_prepare_model``'s tail grouping, with no call to read: the
    release decides."""
    import accelerate
    from packaging.version import Version

    return Version(accelerate.__version__) >= Version("1.15")


def accelerate_offloads_checkpointed_activations() -> bool:
    """Whether accelerate's FSDP plugin has ``activation_checkpointing_offload`` (1.15 on): FSDP2 activation
    checkpointing whose saved inputs go to the host (``offload_wrapper``). 1.14 refuses the keyword."""
    import dataclasses

    from accelerate.utils import FullyShardedDataParallelPlugin

    return any(f.name == "activation_checkpointing_offload" for f in dataclasses.fields(FullyShardedDataParallelPlugin))


def torch_records_meta_offsets() -> bool:
    """Whether the installed torch records where each storage lies in a ``torch.save`` file when it loads it on
    ``meta`` (2.11 on): the optimizer reload reads each tensor there. Without, it maps the file and copies from the
    mapping, and the live-tensor figure counts the mapped file's tensors too (the file's pages, not the process's
    own memory): the memory tests add them to their bounds there."""
    import tempfile
    from pathlib import Path

    import torch

    from accelerate_memsafe import _compat

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "probe.bin"
        torch.save({"t": torch.zeros(4)}, path)
        loaded = torch.load(path, map_location="meta", weights_only=True)
    return _compat.checkpoint_file_offset(loaded["t"]) is not None
