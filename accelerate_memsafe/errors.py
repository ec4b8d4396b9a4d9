"""The exceptions of accelerate_memsafe. Every message says what failed, shows the value, and gives the fix."""

from __future__ import annotations


class MemSafeError(RuntimeError):
    """Base class of every error raised by accelerate_memsafe."""


class PipelineError(MemSafeError, ValueError):
    """The configured stage pipeline is invalid (raised when the plugin is built, listing every problem).

    Args:
        problems: One line per problem, each saying how to fix it.
    """

    def __init__(self, problems: list[str]) -> None:
        self.problems = list(problems)
        body = "\n".join(f"  - {p}" for p in self.problems)
        super().__init__(f"Invalid MemSafePlugin pipeline ({len(self.problems)} problem(s)):\n{body}")


class ConfigError(MemSafeError, ValueError):
    """A plugin option or an ``ACCELERATE_MEMSAFE_*`` environment variable has a bad value."""


class StageError(MemSafeError):
    """A stage failed; the message names the hook, the stage and the rank."""


class CollectiveTimeoutError(MemSafeError, TimeoutError):
    """A collective issued by a stage did not complete within ``collective_timeout_s``."""


class CheckpointError(MemSafeError, ValueError):
    """A checkpoint (or a source of weights) is incomplete, corrupt, or does not match the model."""


class MemoryBudgetError(MemSafeError, MemoryError):
    """The predicted peak memory of a stage does not fit the available memory."""
