"""accelerate_memsafe: bounded, predictable, reported peak memory for the memory-critical moments of an
Accelerate training run (``prepare``, ``load_state``, ``save_state``, ``save_model``).

Example:
    >>> from accelerate_memsafe import Accelerator, MemSafePlugin
    >>> # accelerator = Accelerator(plugins=[MemSafePlugin()], fsdp_plugin=...)
"""

from .accelerator import Accelerator
from .errors import (
    CheckpointError,
    CollectiveTimeoutError,
    ConfigError,
    MemoryBudgetError,
    MemSafeError,
    PeerStageError,
    PipelineError,
    StageError,
)
from .integrations.peft import reload_adapter
from .io.offloaded_save import save_offloaded
from .loading import from_config, from_pretrained
from .memory.report import MemoryReport, StageRecord
from .pipeline import HOOKS, Stage
from .plugin import MemSafePlugin
from .stages import DEFAULT_STAGES

__version__ = "0.1.0"

__all__ = [
    "Accelerator",
    "CheckpointError",
    "CollectiveTimeoutError",
    "ConfigError",
    "DEFAULT_STAGES",
    "HOOKS",
    "MemSafeError",
    "MemSafePlugin",
    "MemoryBudgetError",
    "MemoryReport",
    "PeerStageError",
    "PipelineError",
    "Stage",
    "StageError",
    "StageRecord",
    "__version__",
    "from_config",
    "from_pretrained",
    "save_offloaded",
    "reload_adapter",
]
