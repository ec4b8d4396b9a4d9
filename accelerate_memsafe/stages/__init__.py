"""The stages, one file each. ``DEFAULT_STAGES`` is the whole default pipeline, in run order.

Within a hook point the order of this tuple is the run order; each stage declares the hook points it
serves, so one list describes every hook. To add a stage: write one file with a :class:`Stage`
subclass, import it here and put its name in ``DEFAULT_STAGES``.
"""

from __future__ import annotations

from ..pipeline import Stage
from .shard import ShardStage

_ALL: tuple[type[Stage], ...] = (ShardStage,)

#: Every stage by name.
STAGE_REGISTRY: dict[str, type[Stage]] = {cls.name: cls for cls in _ALL}

#: The default pipeline (every stage enabled), in run order.
DEFAULT_STAGES: tuple[str, ...] = ("shard",)

__all__ = ["DEFAULT_STAGES", "STAGE_REGISTRY"]
