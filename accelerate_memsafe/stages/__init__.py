"""The stages, one file each. ``DEFAULT_STAGES`` is the whole default pipeline, in run order.

Within a hook point the order of this tuple is the run order; each stage declares the hook points it
serves, so one list describes every hook. To add a stage: write one file with a :class:`Stage`
subclass, import it here and put its name in ``DEFAULT_STAGES``.
"""

from __future__ import annotations

from ..pipeline import Stage
from .offloaded_save import OffloadedSaveStage
from .atomic_checkpoint import AtomicCheckpointStage
from .dataloader_resume import DataLoaderResumeStage
from .buffer_init import BufferInitStage
from .meta_placement import MetaPlacementStage
from .optimizer_cpu_reload import OptimizerCpuReloadStage
from .optimizer_offload import OptimizerOffloadStage
from .peft_cpu_reload import PeftCpuReloadStage
from .rank0_distribute import Rank0DistributeStage
from .shard import ShardStage

_ALL: tuple[type[Stage], ...] = (MetaPlacementStage, ShardStage, Rank0DistributeStage, BufferInitStage, OffloadedSaveStage, OptimizerOffloadStage, AtomicCheckpointStage, OptimizerCpuReloadStage, DataLoaderResumeStage, PeftCpuReloadStage,)

#: Every stage by name.
STAGE_REGISTRY: dict[str, type[Stage]] = {cls.name: cls for cls in _ALL}

#: The default pipeline (every stage enabled), in run order.
DEFAULT_STAGES: tuple[str, ...] = ("meta_placement", "shard", "rank0_distribute", "buffer_init", "optimizer_offload", "atomic_checkpoint", "optimizer_cpu_reload", "dataloader_resume", "peft_cpu_reload", "offloaded_save")

__all__ = ["DEFAULT_STAGES", "STAGE_REGISTRY"]
