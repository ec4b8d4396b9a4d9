"""The one module that touches accelerate internals, each behind a version check and a test.

1. ``PartialState._shared_state`` / ``AcceleratorState``: accelerate 1.x never selects FSDP on a machine
   without an accelerator (``MULTI_CPU`` is not in the list of types that may become ``FSDP``), and
   ``AcceleratorState()`` re-copies ``PartialState``'s shared dict, so both must say ``FSDP``.
2. ``fsdp2_prepare_model(accelerator, model)`` reads a handful of attributes of the accelerator; we call
   it with a minimal view holding only those, so that our ``shard`` stage applies exactly accelerate's
   wrapping without its full-state-dict broadcast.
"""

from __future__ import annotations

import copy
import warnings
from types import SimpleNamespace
from typing import Any

import accelerate
import torch
from accelerate.state import AcceleratorState, PartialState
from accelerate.utils import DistributedType
from packaging.version import Version

#: accelerate versions whose internals this module was written and tested against.
TESTED_ACCELERATE = (Version("1.10.0"), Version("1.16.0"))


def check_accelerate_version(version: str | None = None) -> bool:
    """Warns (once per call site) when accelerate's version is outside the tested range.

    Returns:
        Whether the version is a tested one.
    """
    v = Version(version or accelerate.__version__)
    ok = TESTED_ACCELERATE[0] <= v < TESTED_ACCELERATE[1]
    if not ok:
        warnings.warn(
            f"accelerate_memsafe was tested with accelerate >={TESTED_ACCELERATE[0]},<{TESTED_ACCELERATE[1]}; "
            f"found {v}. The CPU-FSDP2 promotion and the `shard` stage use accelerate internals that may have "
            "changed. Please report problems with the versions involved.",
            stacklevel=2,
        )
    return ok


def promote_state_to_fsdp(fsdp_plugin: Any) -> None:
    """Makes the already-initialised accelerate state say FSDP (for CPU multi-process runs).

    Args:
        fsdp_plugin: The ``FullyShardedDataParallelPlugin`` to install.

    Raises:
        RuntimeError: If the state is not a multi-process CPU state (nothing to promote).
    """
    check_accelerate_version()
    state = AcceleratorState()
    if state.distributed_type not in (DistributedType.MULTI_CPU, DistributedType.FSDP):
        raise RuntimeError(
            f"Cannot run FSDP2 on CPU: accelerate state is {state.distributed_type} with {state.num_processes} "
            "process(es). Launch with `torchrun --nproc_per_node N` or `accelerate launch --num_processes N`."
        )
    if state.mixed_precision != "no":
        fsdp_plugin.set_mixed_precision(state.mixed_precision)
    state.fsdp_plugin = fsdp_plugin
    state.distributed_type = DistributedType.FSDP
    PartialState._shared_state["distributed_type"] = DistributedType.FSDP


def reinit_state_on_cpu(fsdp_plugin: Any) -> None:
    """Re-initialises a single-process (``NO``) accelerate state as a gloo ``MULTI_CPU`` state, then FSDP.

    Used by ``MemSafePlugin.attach`` on a stock ``Accelerator`` that was built in a multi-process launch
    on a machine without an accelerator: stock accelerate then runs every process as rank 0 of 1.
    """
    check_accelerate_version()
    old = AcceleratorState()
    kept = {
        "mixed_precision": old.mixed_precision,
        "dynamo_plugin": getattr(old, "dynamo_plugin", None),
        "parallelism_config": getattr(old, "parallelism_config", None),
    }
    AcceleratorState._reset_state(reset_partial_state=True)
    PartialState(cpu=True)
    AcceleratorState(cpu=True, _from_accelerator=True, **kept)
    promote_state_to_fsdp(fsdp_plugin)


def fsdp2_wrap(
    model: torch.nn.Module,
    *,
    fsdp_plugin: Any,
    mixed_precision: str,
    mesh: Any,
    parallelism_config: Any,
    is_main_process: bool,
    device: torch.device,
) -> torch.nn.Module:
    """Applies accelerate's FSDP2 wrapping (wrap policy, mixed precision, offload) without loading weights.

    Calls ``accelerate.utils.fsdp2_prepare_model`` with a copy of the plugin whose
    ``cpu_ram_efficient_loading`` is off (our ``rank0_distribute`` stage does the loading) and a minimal
    view of the accelerator holding only the attributes that function reads.
    """
    from accelerate.utils import fsdp2_prepare_model

    check_accelerate_version()
    plugin = copy.copy(fsdp_plugin)
    plugin.cpu_ram_efficient_loading = False
    view = SimpleNamespace(
        state=SimpleNamespace(fsdp_plugin=plugin),
        torch_device_mesh=mesh,
        parallelism_config=parallelism_config,
        mixed_precision=mixed_precision,
        is_main_process=is_main_process,
        device=device,
    )
    return fsdp2_prepare_model(view, model)


def apply_activation_checkpointing(model: torch.nn.Module, fsdp_plugin: Any) -> torch.nn.Module:
    """Applies accelerate's activation checkpointing (must come before ``fully_shard``)."""
    from accelerate.utils import fsdp2_apply_ac

    return fsdp2_apply_ac(SimpleNamespace(state=SimpleNamespace(fsdp_plugin=fsdp_plugin)), model)
