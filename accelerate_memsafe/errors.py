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
    """A plugin option or an ``ACCELERATE_MEMSAFE_*`` environment variable has a bad value, or the installed torch is
    below what the package needs (a ``pip install --no-deps`` can leave one)."""


class StageError(MemSafeError):
    """A stage failed; the message names the hook, the stage and the rank."""


class CollectiveTimeoutError(MemSafeError, TimeoutError):
    """A collective issued by a stage did not complete within ``collective_timeout_s``."""


class PeerStageError(StageError):
    """Another rank failed during the same hook call; raised on this rank within seconds (instead of
    waiting in a collective until ``collective_timeout_s``). The message names the stage, the hook and the
    rank that failed, with that rank's own error message, and where this rank stopped.

    Attributes:
        failed_rank: The rank that failed first (``None`` if unknown).
        stage: The stage it failed in (``accelerate.<hook>`` for accelerate's own call).
        hook: The hook point.
        peer_message: Its error, as ``"ExceptionType: message"``.
        collective_abandoned: Whether this rank left a collective its peer never joined. The ranks' next
            collectives would then pair up wrongly, so the process group must not be used again: restart
            the processes (``torchrun`` restarts the whole worker group). ``False`` when this rank stopped
            at an agreement point, where the process group stays usable.
    """

    def __init__(
        self,
        message: str,
        *,
        failed_rank: int | None = None,
        stage: str | None = None,
        hook: str | None = None,
        peer_message: str | None = None,
        collective_abandoned: bool = False,
    ) -> None:
        super().__init__(message)
        self.failed_rank = failed_rank
        self.stage = stage
        self.hook = hook
        self.peer_message = peer_message
        self.collective_abandoned = collective_abandoned


class CheckpointError(MemSafeError, ValueError):
    """A checkpoint (or a source of weights) is incomplete, corrupt, or does not match the model."""


class MemoryBudgetError(MemSafeError, MemoryError):
    """The predicted peak memory of a stage does not fit the available memory."""


def message_line(exc: BaseException, *, prefer: tuple[str, ...] = ()) -> str:
    """The one line of ``exc``'s message that an error of ours quotes: the first line holding one of ``prefer``
    (e.g. the global an unpickler refused), else the first non-empty line; ``""`` for an empty message.

    Example:
        >>> message_line(ValueError("Weights only load failed.\\n  GLOBAL os.system was not an allowed global"),
        ...              prefer=("GLOBAL",))
        'GLOBAL os.system was not an allowed global'
        >>> message_line(OSError("\\nunexpected end of file\\nat offset 8"))
        'unexpected end of file'
    """
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return next((line for line in lines if any(p in line for p in prefer)), lines[0] if lines else "")
