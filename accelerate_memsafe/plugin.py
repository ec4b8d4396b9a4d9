"""``MemSafePlugin``: which stages run, with which options; ``from_env()``; ``attach()``."""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from .env import PREFIX, memsafe_variables
from .errors import ConfigError, PipelineError
from .sizes import parse_size
from .memory.report import MemoryReport
from .pipeline import HOOKS, Pipeline, validate_stage_names

if TYPE_CHECKING:
    import accelerate


@dataclass(frozen=True, kw_only=True)
class MemSafePlugin:
    """Configuration of the memory-safe pipeline. Pass it as ``Accelerator(plugins=[MemSafePlugin()])``.

    The pipeline is validated when the plugin is built: an unknown stage, a duplicate, or an order that
    breaks a stage's requirements raises :class:`PipelineError` listing every problem.

    Example:
        >>> plugin = MemSafePlugin(stages=["shard"], bucket_bytes="32MiB")
        >>> plugin.bucket_bytes
        33554432
        >>> plugin.stage_names("prepare")
        ('shard',)
    """

    stages: tuple[str, ...] | None = None
    """Stage names in run order (each stage serves its own hook points). ``None``: every stage, default order."""

    bucket_bytes: int = 64 * 2**20
    """Bound on rank 0's cast copies in flight while it sends weights at ``prepare`` (``load_source="rank0"``, and
    what rank 0 sends under ``"node"``). Each bucket is ``bucket_bytes // (prefetch_buckets + 2)`` bytes (16 MiB with
    the defaults): rank 0 keeps at most ``prefetch_buckets + 1`` buckets plus one conversion temporary alive, so
    the total stays within ``bucket_bytes``; every other rank receives its part of a bucket (at most a bucket divided
    by the number of ranks) in place or into one of two alternating staging buffers. Accepts ``"32MiB"``,
    ``"500MB"``."""

    prefetch_buckets: int = 2
    """How many buckets rank 0 reads ahead while the current one is sent (hard bound on what is in flight)."""

    load_source: str = "auto"
    """Where the ranks get their weights at ``prepare``: ``"rank0"`` (rank 0 reads and scatters each rank's
    block), ``"node"`` (each node's leader reads or receives its node's blocks, at most one copy per node from rank
    0, and scatters them within the node), ``"every_rank"`` (each rank reads its own block from the checkpoint:
    every rank must see rank 0's checkpoint, same size, modification time and header), ``"auto"`` (on the CPU, the
    weights stay in place when every rank already maps them, unmodified, from the same checkpoint, as transformers'
    ``from_pretrained`` on every rank does: ``fully_shard`` keeps each rank's rows; else ``every_rank`` where valid,
    else ``node`` when every node's leader sees the checkpoint, else ``rank0``; the report says which and why)."""

    optimizer_offload: bool = False
    """Keep optimizer state on CPU between steps (and reload it straight to CPU)."""

    collective_timeout_s: float = 600.0
    """Seconds a collective issued by a stage may take before the stage fails naming the missing rank."""

    max_shard_size: int = 5 * 10**9
    """Largest shard file written by the offloaded save (bytes; accepts '500MB'-style strings)."""

    drop_file_pages: bool = False
    """On the in-place path of ``prepare`` (``load_source="auto"``: every rank maps the same unmodified checkpoint,
    the weights stay where they are), drop each FSDP group's mapped file pages from this rank's RSS once
    ``fully_shard`` has copied its rows (``madvise(MADV_DONTNEED)`` of clean file pages: the next access reads the
    file again; ``shard``'s ``file_pages_dropped_bytes`` in the report). It lowers RSS, never RssAnon: those pages are
    shared, reclaimable page cache, which stock accelerate keeps mapped until the end of ``prepare``; off by default
    because unmapping them costs about 15 ms per GB of weights a rank touched, on the critical path."""

    check_finite_weights: bool = False
    """Check every source weight for NaN/Inf while distributing it (costs one pass over the weights)."""

    preflight_memory_check: bool = True
    """Before a stage runs, predict its peak memory and refuse to start work that cannot fit."""

    async_checkpoint: bool = True
    """Commit ``save_state``'s checkpoint in the background: ``save_state`` returns once every rank has written its
    files; rank 0 fsyncs them, writes the completeness marker and swaps the directory into place in a thread, and
    the next hook, ``wait_for_everyone()``, ``end_training()`` or :meth:`wait_for_checkpoint` waits for it (raising
    its error on every rank). ``False``: all of it before ``save_state`` returns."""

    track_live_tensors: bool = False
    """Run the dispatch-level live-tensor tracker inside each stage: exact peaks of live tensor bytes
    (``live_tensor_peak_bytes``), at a cost per aten op that makes op-heavy hooks (an FSDP2 ``load_state``) measurably
    slower. Off: ``live_tensor_peak_bytes`` is ``None`` and the report's ``not_measured`` says why."""

    memory_sample_interval_s: float = 0.01
    """Seconds between two samples of RSS and RssAnon (and device memory) while a stage runs. Each sample costs the
    sampled rank CPU time and a hand-off of the GIL, which shows in a short multi-process ``prepare`` on a machine
    whose cores the ranks share (docs/benchmarks.md). A rise and fall of memory shorter than the interval is not seen
    (RSS above the process's earlier high-water mark still is, through ``VmHWM``; device peaks above an earlier
    high-water mark too); the report's ``not_measured`` says so. ``0.002`` samples five times as often."""

    probe_hooks_without_stages: bool = False
    """Measure memory through accelerate's own call also in a one-process hook call where no stage ran (its
    ``prepare``, where every stage skips: the plugin changes nothing there). Off: that call is timed only, its record's
    memory figures are ``None`` (``details["memory_measured"] = False``), and the report's ``not_measured`` says so:
    the memory readings around it (system calls of up to 60 µs each) cost a call of a few milliseconds a tenth of
    its wall (docs/benchmarks.md). With several processes accelerate's call is always measured."""

    memory_trim_heap: bool = False
    """Hand the heap glibc keeps after frees back to the kernel (``malloc_trim``) before each stage, so that the
    stage's RssAnon figures count what it takes from the kernel, not less where it reuses memory freed before it (a
    load's temporaries, an earlier stage's buffers): the figures ``accelerate-memsafe estimate`` predicts, and what
    ``benchmarks/estimate.py`` measures with. Off by default: a trim costs time, and the next allocations fault the
    pages in again (a second ``prepare`` in one process took twice as long as stock's with it on every stage)."""

    progress: bool = True
    """Show tqdm progress bars on rank 0 for stages that move more than a few hundred MB."""

    report_path: str | None = None
    """Where every rank's records are written as JSON after each hook (``{rank}`` is replaced)."""

    report: MemoryReport = field(default_factory=MemoryReport, compare=False, repr=False)
    """The records of this plugin's stage runs (filled as the hooks run)."""

    def __post_init__(self) -> None:
        from .stages import DEFAULT_STAGES, STAGE_REGISTRY

        if self.stages is not None:
            if isinstance(self.stages, str):
                raise PipelineError([f"`stages` must be a list of stage names, got the string {self.stages!r}."])
            object.__setattr__(self, "stages", tuple(self.stages))
        object.__setattr__(self, "bucket_bytes", parse_size(self.bucket_bytes, what="bucket_bytes"))
        object.__setattr__(self, "max_shard_size", parse_size(self.max_shard_size, what="max_shard_size"))
        problems = []
        from .distributed.local_read import LOAD_SOURCES

        if self.load_source not in LOAD_SOURCES:
            problems.append(f"`load_source` must be one of {', '.join(LOAD_SOURCES)}, got {self.load_source!r}.")
        if not isinstance(self.prefetch_buckets, int) or self.prefetch_buckets < 1:
            problems.append(f"`prefetch_buckets` must be an int >= 1, got {self.prefetch_buckets!r}.")
        if not (isinstance(self.collective_timeout_s, (int, float)) and self.collective_timeout_s > 0):
            problems.append(f"`collective_timeout_s` must be > 0 seconds, got {self.collective_timeout_s!r}.")
        if not (isinstance(self.memory_sample_interval_s, (int, float)) and not isinstance(self.memory_sample_interval_s, bool)
                and 0 < self.memory_sample_interval_s <= 1):
            problems.append("`memory_sample_interval_s` must be > 0 and <= 1 second, got "
                            f"{self.memory_sample_interval_s!r}.")
        if problems:
            raise ConfigError(" ".join(problems))
        names = DEFAULT_STAGES if self.stages is None else self.stages
        by_hook = validate_stage_names(names, STAGE_REGISTRY)
        instances = {hook: tuple(cls(self) for cls in classes) for hook, classes in by_hook.items()}
        if not self.track_live_tensors:
            self.report.not_measured["live_tensor_peak_bytes"] = (
                "the live-tensor tracker is off (`track_live_tensors=False`, the default: it runs Python on every aten "
                "op); RSS, RssAnon and device peaks are measured. Turn it on with `MemSafePlugin(track_live_tensors=True)`.")
        self.report.not_measured["cpu_peaks_between_samples"] = (
            f"RSS and RssAnon are sampled every {self.memory_sample_interval_s * 1e3:g} ms "
            "(`memory_sample_interval_s`): a rise and fall of memory inside a stage shorter than that is not seen, "
            "except RSS above the process's earlier high-water mark (VmHWM). Sample more often with "
            "`MemSafePlugin(memory_sample_interval_s=0.002)`, at more CPU time per second of the stage.")
        if not self.probe_hooks_without_stages:
            self.report.not_measured["hooks_without_stages"] = (
                "in a one-process hook call where no stage ran (its `prepare`), accelerate's own call is timed "
                "only: its record's memory figures are None (`memory_measured` is False in its details). Measure it "
                "with `MemSafePlugin(probe_hooks_without_stages=True)`.")
        object.__setattr__(self, "_pipeline", Pipeline(instances, self.report, track_tensors=self.track_live_tensors,
                                                       sample_interval_s=self.memory_sample_interval_s,
                                                       trim_heap=self.memory_trim_heap,
                                                       probe_hooks_without_stages=self.probe_hooks_without_stages))

    @property
    def pipeline(self) -> Pipeline:
        """The validated pipeline (stage instances per hook point)."""
        return self._pipeline  # type: ignore[attr-defined]

    def wait_for_checkpoint(self) -> str | None:
        """Waits until this process's last ``save_state`` checkpoint is committed (durable and in place): rank 0
        waits for its background commit, other ranks return at once. No collective: it may be called on rank 0
        alone (e.g. before uploading the checkpoint). To wait on every rank, call ``accelerator.wait_for_everyone()``.

        Returns:
            The committed checkpoint directory (rank 0), or ``None`` when nothing was pending or on other ranks.

        Raises:
            CheckpointError: If the commit failed (the previous checkpoint of that name is still in place). With
                several processes the error is raised again, on every rank, at the next hook or
                ``wait_for_everyone()``.

        Example:
            >>> MemSafePlugin().wait_for_checkpoint() is None
            True
        """
        result = self.pipeline.background.wait()
        return result.get("final") if isinstance(result, dict) else None

    def stage_names(self, hook: str) -> tuple[str, ...]:
        """The stages that run at ``hook`` (one of ``prepare``, ``load_state``, ``save_state``, ``save_model``)."""
        if hook not in HOOKS:
            raise ValueError(f"unknown hook {hook!r}; hooks are {', '.join(HOOKS)}.")
        return self.pipeline.names(hook)

    @classmethod
    def options(cls) -> tuple[dataclasses.Field, ...]:
        """The configurable fields (everything but ``report``)."""
        return tuple(f for f in dataclasses.fields(cls) if f.name != "report")

    @classmethod
    def env_name(cls, option: str) -> str:
        """The environment variable carrying ``option`` (``bucket_bytes`` -> ``ACCELERATE_MEMSAFE_BUCKET_BYTES``)."""
        return PREFIX + option.upper()

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides: Any) -> MemSafePlugin:
        """Builds a plugin from ``ACCELERATE_MEMSAFE_*`` variables (the only place that reads them).

        Args:
            environ: Mapping to read instead of ``os.environ``.
            **overrides: Options that win over the environment.

        Raises:
            ConfigError: For an unknown ``ACCELERATE_MEMSAFE_*`` variable or a value that does not parse.

        Example:
            >>> MemSafePlugin.from_env({"ACCELERATE_MEMSAFE_STAGES": "shard", "ACCELERATE_MEMSAFE_OPTIMIZER_OFFLOAD": "1"}).optimizer_offload
            True
        """
        variables = memsafe_variables(environ)
        fields = {f.name: f for f in cls.options()}
        unknown = sorted(k for k in variables if k not in fields)
        if unknown:
            raise ConfigError(
                f"unknown environment variable(s) {[cls.env_name(k) for k in unknown]}. "
                f"Known: {[cls.env_name(k) for k in fields]}."
            )
        hints = typing.get_type_hints(cls)
        kwargs: dict[str, Any] = {}
        for name, raw in variables.items():
            kwargs[name] = _parse_env_value(cls.env_name(name), raw, hints[name])
        kwargs.update(overrides)
        return cls(**kwargs)

    def to_env(self) -> dict[str, str]:
        """The ``ACCELERATE_MEMSAFE_*`` variables that rebuild this plugin with :meth:`from_env`."""
        out = {}
        for f in self.options():
            value = getattr(self, f.name)
            if value is None:
                continue
            if isinstance(value, tuple):
                value = ",".join(value)
            elif isinstance(value, bool):
                value = "true" if value else "false"
            out[self.env_name(f.name)] = str(value)
        return out

    def attach(self, accelerator: accelerate.Accelerator, *, fsdp_plugin: Any = None) -> accelerate.Accelerator:
        """Gives an existing stock ``accelerate.Accelerator`` the behaviour of :class:`accelerate_memsafe.Accelerator`.

        The instance's class is switched to a memsafe subclass of its own class (no module globals are
        patched). On a machine without an accelerator, a multi-process launch that asked for FSDP2
        (``accelerate launch --use_fsdp --fsdp_version 2``, or ``fsdp_plugin=...`` here) is turned into a
        real FSDP2 run over gloo.

        Args:
            accelerator: A stock accelerator, built before any ``prepare``.
            fsdp_plugin: FSDP settings to use (default: those of the accelerator or the environment).

        Returns:
            The same accelerator object.

        Raises:
            ValueError: If the accelerator already has a memsafe plugin or has prepared objects.

        Example:
            >>> # accelerator = accelerate.Accelerator(); MemSafePlugin().attach(accelerator)
        """
        from .accelerator import attach_plugin

        return attach_plugin(accelerator, self, fsdp_plugin=fsdp_plugin)


def _parse_env_value(var: str, raw: str, hint: Any) -> Any:
    text = raw.strip()
    origin = typing.get_origin(hint)
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    if hint is bool:
        if text.lower() in ("1", "true", "yes", "on"):
            return True
        if text.lower() in ("0", "false", "no", "off"):
            return False
        raise ConfigError(f"{var}={raw!r} is not a boolean; use true or false.")
    if origin is not None and args and (typing.get_origin(args[0]) is tuple or args[0] is tuple):
        return tuple(s.strip() for s in text.split(",") if s.strip())
    if hint is int:
        try:
            return parse_size(text, what=var) if not text.lstrip("-").isdigit() else int(text)
        except ConfigError:
            raise ConfigError(f"{var}={raw!r} is not an integer.") from None
    if hint is float:
        try:
            return float(text)
        except ValueError:
            raise ConfigError(f"{var}={raw!r} is not a number.") from None
    return text or None
