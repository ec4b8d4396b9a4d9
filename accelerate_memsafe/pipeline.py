"""Stages, their validation, and the runner that wraps each one in the memory probe.

A stage is a small class with a ``name``, the ``hooks`` it serves, the stages it ``requires`` to have
run before it (at the same hook), the stages it must ``run_before`` when both are enabled, and
``run(ctx)``. Stages orchestrate; plain functions in ``distributed/``, ``io/`` and ``memory/`` do the work.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from . import walk
from .background import BackgroundWork, process_work
from .distributed.collectives import check_not_abandoned, gc_paused, hook_scope
from .errors import PeerStageError, PipelineError
from .memory.limits import cpu_memory_limit
from .memory.probe import SAMPLE_INTERVAL_S, MemoryProbe, ProbeResult
from .memory.report import MemoryReport, StageRecord

if TYPE_CHECKING:
    from .plugin import MemSafePlugin

#: The hook points, in the order a training run meets them.
HOOKS = ("prepare", "load_state", "save_state", "save_model")
#: ``ctx.scratch`` key of what every rank announced before the stages ran: stage name -> values in rank order.
ANNOUNCED_KEY = "announced"


@dataclass
class StageOutcome:
    """What a stage returns: whether it ran or was skipped (and why), plus figures for the report."""

    status: str = "ran"
    reason: str | None = None
    details: dict[str, Any] = field(default_factory=dict)


def ran(**details: Any) -> StageOutcome:
    """Outcome of a stage that did its work; ``details`` go into the report."""
    return StageOutcome("ran", None, details)


def skipped(reason: str, **details: Any) -> StageOutcome:
    """Outcome of a stage that does not apply here; ``reason`` says why (it is shown in the report)."""
    return StageOutcome("skipped", reason, details)


class Stage:
    """Base class of a pipeline stage. Subclasses set the class attributes and implement :meth:`run`.

    A stage may also implement :meth:`after`, which runs once the upstream accelerate call of the hook
    has returned (in reverse stage order, like nested context managers), e.g. to rename a finished
    checkpoint into place or to reclaim device memory after a load.
    """

    name: ClassVar[str]
    hooks: ClassVar[tuple[str, ...]]
    requires: ClassVar[tuple[str, ...]] = ()
    run_before: ClassVar[tuple[str, ...]] = ()
    completed_by: ClassVar[tuple[str, ...]] = ()
    """Stages that must also be enabled (later, at the same hook) for this one's work to be complete, e.g.
    weights moved to ``meta`` must be refilled."""
    summary: ClassVar[str] = ""

    def __init__(self, options: MemSafePlugin) -> None:
        self.options = options

    def skip_reason(self, ctx: HookContext) -> str | None:
        """Why this stage does not apply to this hook call (``None``: it runs), asked before the stage is probed.

        A stage skipped here costs nothing: no probe, no sampler thread, no tracker, and its record carries the
        reason only (no time, no memory figure). The check must be cheap and change nothing: no collective, no
        heavy import (peft, transformers internals), no I/O beyond a ``stat``. Where :meth:`run` issues
        collectives, every rank must reach the same answer, so decide on the model, the configuration and what
        earlier stages decided on every rank, never on rank-local data (files, memory); such checks, and any
        check that needs a collective, stay in :meth:`run`, which may still return :func:`skipped`.

        Example:
            >>> class Offload(Stage):
            ...     name, hooks = "offload", ("prepare",)
            ...     def skip_reason(self, ctx):
            ...         return None if ctx.optimizers else "no optimizer passed to prepare"
        """
        return None

    def fixed_skip_reason(self, ctx: HookContext) -> str | None:
        """Why this stage skips *every* call of ``ctx.hook`` on this accelerator (``None``: :meth:`skip_reason` decides
        call by call), decided from what is fixed once the accelerator is built: ``ctx.hook``, ``ctx.world_size``,
        ``ctx.is_fsdp2`` and the plugin's options, never anything else of ``ctx``. The pipeline asks it once per hook,
        world size and FSDP2-or-not, and then skips the stage on every such call without asking :meth:`skip_reason`,
        so the reason must be the one :meth:`skip_reason` would give (a test holds every stage to it): a one-process
        ``prepare``, where every stage skips, then costs no per-call look at the model, the optimizers or the
        arguments.

        Example:
            >>> class Spread(Stage):
            ...     name, hooks = "spread", ("prepare",)
            ...     def fixed_skip_reason(self, ctx):
            ...         return "single process" if ctx.world_size < 2 else None
            ...     skip_reason = fixed_skip_reason
        """
        return None

    def run(self, ctx: HookContext) -> StageOutcome | None:
        raise NotImplementedError

    def after(self, ctx: HookContext) -> StageOutcome | None:
        return None

    def announce(self, ctx: HookContext) -> Any:
        """What this rank tells the others before any stage runs (a small picklable value; ``None``: nothing).

        Called on every rank before the first stage, when the stage is enabled at the hook. Every rank's value
        travels in the preflight's one exchange (with the memory estimates), and :meth:`run` finds them, in rank
        order, in ``ctx.scratch[ANNOUNCED_KEY][self.name]`` (on one process: this rank's value alone). A stage that
        needs every rank's view to decide (one plan, the same on every rank) saves its own collective this way. It
        runs before :meth:`skip_reason`: a stage that may skip returns ``None`` when it will.
        """
        return None

    def estimate(self, ctx: HookContext) -> MemoryEstimate | None:
        """Predicted extra peak memory of :meth:`run` on this rank (``None``: no prediction).

        With ``preflight_memory_check`` on, the pipeline compares it with the available memory before
        the stage starts and raises :class:`MemoryBudgetError` instead of starting work that cannot fit.
        """
        return None

    def needs_estimate(self, ctx: HookContext) -> bool:
        """Whether the preflight asks :meth:`estimate` at all, decided once every rank's announcements are known.

        A stage that overrides this has its estimate asked *after* the preflight's exchange, only where this returns
        ``True``, and its figures travel in a second, small exchange (made only then). Decide from the settings and
        ``ctx.scratch[ANNOUNCED_KEY]`` only, which are the same on every rank, never from rank-local data: every rank
        must reach the same answer. Worth it for a stage whose estimate costs a walk over the model and that the
        announcements often rule out (``rank0_distribute`` does not run where every rank keeps its weights in place).
        """
        return True

    def __repr__(self) -> str:
        return f"<stage {self.name}>"


@dataclass(frozen=True)
class MemoryEstimate:
    """Predicted extra peak memory of a stage on one rank, in bytes (``device_bytes`` on the accelerator)."""

    cpu_bytes: int = 0
    device_bytes: int = 0
    what: str = ""


def available_memory(device: torch.device | None):
    """The CPU memory this process can still use (a :class:`~accelerate_memsafe.memory.limits.CpuLimit`:
    the host's ``MemAvailable`` or a tighter cgroup limit) and free device memory (``None`` without an
    accelerator)."""
    dev = None
    if device is not None and device.type == "cuda" and torch.cuda.is_available():
        dev = torch.cuda.mem_get_info(device)[0]
    return cpu_memory_limit(), dev


@dataclass(frozen=True)
class RankBudget:
    """What one rank brings to the preflight check: its limits and its stages' estimates."""

    rank: int
    cpu_key: str
    """Ranks with the same key share one CPU limit (a node, or one container's cgroup)."""
    cpu_available: int
    cpu_source: str
    dev_free: int | None
    estimates: dict[str, MemoryEstimate]


def budget_problems(hook: str, budgets: list[RankBudget], local_world_size: int = 1) -> list[str]:
    """Every rank's stage that would not fit, one line each (empty: all fit).

    A stage's CPU need on a node is the sum of the estimates of the ranks that share its limit (they run
    the stage at the same time); where only this rank's budget is known, its estimate counts
    ``local_world_size`` times. Device memory is per rank.

    Example:
        >>> b = RankBudget(0, "h", 3 << 30, "MemAvailable of the host", None, {"s": MemoryEstimate(cpu_bytes=2 << 30)})
        >>> budget_problems("prepare", [b], local_world_size=2)[0].split(" (")[0]
        'stage `s` at hook `prepare` on rank 0 would not fit'
    """
    gib = 2**30
    problems = []
    for b in budgets:
        peers = [o for o in budgets if o.cpu_key == b.cpu_key]
        sharing = len(peers) if len(budgets) > 1 else max(1, local_world_size)
        for name, est in b.estimates.items():
            found = []
            need = sum(o.estimates[name].cpu_bytes for o in peers if name in o.estimates) if len(budgets) > 1 \
                else est.cpu_bytes * sharing
            if need > b.cpu_available:
                who = (f"the {sharing} ranks sharing this limit need {need / gib:.2f} GiB together (this rank "
                       f"{est.cpu_bytes / gib:.2f} GiB)") if sharing > 1 else f"needs {need / gib:.2f} GiB"
                found.append(f"CPU: {who}, {b.cpu_available / gib:.2f} GiB available by the {b.cpu_source}")
            if b.dev_free is not None and est.device_bytes > b.dev_free:
                found.append(f"device: needs {est.device_bytes / gib:.2f} GiB, {b.dev_free / gib:.2f} GiB free")
            if found:
                problems.append(
                    f"stage `{name}` at hook `{hook}` on rank {b.rank} would not fit ({'; '.join(found)})"
                    f"{' for ' + est.what if est.what else ''}")
    return problems


@dataclass
class HookContext:
    """What the stages of one hook call share. Stages read and replace fields; ``scratch`` passes data
    from one stage to a later one (e.g. the weight source from ``meta_placement`` to ``rank0_distribute``).
    """

    hook: str
    rank: int
    world_size: int
    device: torch.device
    options: MemSafePlugin
    args: tuple[Any, ...] = ()
    kwargs: dict[str, Any] = field(default_factory=dict)
    model: torch.nn.Module | None = None
    models: list[torch.nn.Module] = field(default_factory=list)
    optimizers: list[torch.optim.Optimizer] = field(default_factory=list)
    fsdp_plugin: Any = None
    is_fsdp2: bool = False
    mixed_precision: str = "no"
    mesh: Any = None
    directory: str | None = None
    skip_upstream: str | None = None
    result: Any = None
    scratch: dict[str, Any] = field(default_factory=dict)
    background: BackgroundWork | None = None
    """Where a stage leaves work that finishes after the hook returned (rank 0's checkpoint commit); set by
    :meth:`Pipeline.run`, which settles it at the start of the next hook."""

    def parallel_size(self, name: str) -> int:
        """A size of the run's ``ParallelismConfig`` (``"tp_size"``, ``"dp_replicate_size"``), 1 without one.

        Example:
            >>> HookContext("prepare", 0, 1, torch.device("cpu"), None).parallel_size("tp_size")
            1
        """
        return getattr(self.scratch.get("parallelism_config"), name, 1) or 1


def validate_stage_names(
    names: Iterable[str], registry: Mapping[str, type[Stage]]
) -> dict[str, tuple[type[Stage], ...]]:
    """Checks a list of stage names and splits it into the run order of each hook.

    Args:
        names: Stage names, in run order.
        registry: Known stages by name.

    Returns:
        For every hook point, the stage classes that run there, in order.

    Raises:
        PipelineError: Listing every unknown name, duplicate, and broken ordering requirement.

    Example:
        >>> from accelerate_memsafe.stages import STAGE_REGISTRY
        >>> validate_stage_names(["shard"], STAGE_REGISTRY)["prepare"][0].name
        'shard'
    """
    names = list(names)
    problems: list[str] = []
    seen: dict[str, int] = {}
    for i, name in enumerate(names):
        if not isinstance(name, str):
            problems.append(f"stage #{i} is {name!r}, not a stage name. Available names: {', '.join(registry)}.")
            continue
        if name in seen:
            problems.append(f"`{name}` is listed twice (positions {seen[name]} and {i}); list each stage once.")
            continue
        seen[name] = i
        if name not in registry:
            problems.append(f"unknown stage `{name}`. Available names: {', '.join(registry)}.")
    known = [n for n in names if isinstance(n, str) and n in registry]
    known = list(dict.fromkeys(known))
    for name in known:
        cls = registry[name]
        bad_hooks = [h for h in cls.hooks if h not in HOOKS]
        if bad_hooks:
            problems.append(f"stage `{name}` declares unknown hook(s) {bad_hooks}; hooks are {', '.join(HOOKS)}.")
        for req in cls.requires:
            if req not in seen:
                problems.append(
                    f"`{name}` requires `{req}` to run before it, but `{req}` is not enabled. "
                    f"HINT: add `{req}` before `{name}`, or remove `{name}`."
                )
            elif seen[req] > seen[name]:
                problems.append(
                    f"`{name}` requires `{req}` to run before it, but `{req}` comes after it. "
                    f"HINT: move `{req}` before `{name}`."
                )
        for later in cls.run_before:
            if later in seen and seen[later] < seen[name]:
                problems.append(f"`{name}` must run before `{later}`. HINT: move `{name}` before `{later}`.")
        missing_later = [s for s in cls.completed_by if s not in seen]
        if missing_later:
            problems.append(
                f"`{name}` needs {', '.join(f'`{s}`' for s in missing_later)} after it to finish its work "
                f"({cls.summary or name}); without it the model would be left unusable. HINT: add "
                f"{', '.join(f'`{s}`' for s in missing_later)} after `{name}`, or remove `{name}`."
            )
    if problems:
        raise PipelineError(problems)
    return {hook: tuple(registry[n] for n in known if hook in registry[n].hooks) for hook in HOOKS}


def _fixed_skip_reason(stage: Stage, ctx: HookContext) -> str | None:
    try:
        return stage.fixed_skip_reason(ctx)
    except Exception:
        return None


def _merge(first: ProbeResult, second: ProbeResult) -> ProbeResult:
    """One stage's two parts (``run`` before accelerate's call, ``after`` after it) as one result: the wall
    time is the stage's own (the sum), and each part keeps its own time span in ``segments``, so the
    timeline does not claim accelerate's call in between."""

    def peak(a, b):
        return b if a is None else a if b is None else max(a, b)

    def add(a, b):
        return None if a is None or b is None else a + b

    return ProbeResult(
        wall_s=first.wall_s + second.wall_s,
        cpu_rss_start_bytes=first.cpu_rss_start_bytes,
        cpu_rss_peak_bytes=peak(first.cpu_rss_peak_bytes, second.cpu_rss_peak_bytes),
        cpu_rss_delta_bytes=add(first.cpu_rss_delta_bytes, second.cpu_rss_delta_bytes),
        cpu_anon_start_bytes=first.cpu_anon_start_bytes,
        cpu_anon_peak_bytes=peak(first.cpu_anon_peak_bytes, second.cpu_anon_peak_bytes),
        cpu_anon_delta_bytes=add(first.cpu_anon_delta_bytes, second.cpu_anon_delta_bytes),
        device_peak_bytes=peak(first.device_peak_bytes, second.device_peak_bytes),
        device_delta_bytes=add(first.device_delta_bytes, second.device_delta_bytes),
        live_tensor_peak_bytes=peak(first.live_tensor_peak_bytes, second.live_tensor_peak_bytes),
        timeline=first.timeline + second.timeline,
        start_s=first.start_s,
        segments=first.segments + second.segments,
    )


class Pipeline:
    """Runs the stages of each hook point in order, each that applies (:meth:`Stage.skip_reason`) inside a
    :class:`MemoryProbe`.

    Args:
        stages: Stage instances per hook (from :func:`validate_stage_names`).
        report: Where records go.
        track_tensors: Whether the probe runs the live-tensor tracker.
        sample_interval_s: Seconds between two samples of the probes' memory thread.
        trim_heap: Whether each probe hands glibc's freed heap back to the kernel first (``memory_trim_heap``).
        probe_hooks_without_stages: Whether accelerate's own call is probed also in a one-process hook call where no
            stage ran (``MemSafePlugin.probe_hooks_without_stages``); otherwise it is timed only there.
    """

    def __init__(self, stages: Mapping[str, tuple[Stage, ...]], report: MemoryReport, *, track_tensors: bool = True,
                 sample_interval_s: float = SAMPLE_INTERVAL_S, trim_heap: bool = False,
                 probe_hooks_without_stages: bool = True):
        self.stages = dict(stages)
        self.report = report
        self.track_tensors = track_tensors
        self.sample_interval_s = sample_interval_s
        self.trim_heap = trim_heap
        self.probe_hooks_without_stages = probe_hooks_without_stages
        self.origin = time.perf_counter()
        self.background = process_work()  # one per process: any accelerator's next hook settles it
        self._fixed: dict[tuple[str, int, bool], tuple[str | None, ...]] = {}

    def names(self, hook: str) -> tuple[str, ...]:
        """The stage names that run at ``hook``, in order."""
        return tuple(s.name for s in self.stages.get(hook, ()))

    def _probe(self, ctx: HookContext, fn: Callable[[HookContext], StageOutcome | None], stage: str):
        probe = MemoryProbe(ctx.device, track_tensors=self.track_tensors, origin=self.origin,
                            interval_s=self.sample_interval_s, trim_heap=self.trim_heap)
        start = time.perf_counter() - self.origin
        try:
            with probe:
                outcome = fn(ctx)
        except Exception as exc:
            self._fail(ctx, stage, exc, probe.result.wall_s if probe.result else 0.0, start)
            raise
        return probe.result, outcome or StageOutcome(), start

    def _time(self, ctx: HookContext, fn: Callable[[HookContext], StageOutcome | None], stage: str):
        """:meth:`_probe` with the wall time only: no memory reading (each is a system call, 60 µs for the first in a
        while) and no sampling thread (its wake-up is a hand-off of the GIL)."""
        t0 = time.perf_counter()
        try:
            outcome = fn(ctx)
        except Exception as exc:
            self._fail(ctx, stage, exc, time.perf_counter() - t0, t0 - self.origin)
            raise
        wall = time.perf_counter() - t0
        result = ProbeResult(wall_s=wall, cpu_rss_start_bytes=None, cpu_rss_peak_bytes=None, cpu_rss_delta_bytes=None,
                             cpu_anon_start_bytes=None, cpu_anon_peak_bytes=None, cpu_anon_delta_bytes=None,
                             device_peak_bytes=None, device_delta_bytes=None, live_tensor_peak_bytes=None,
                             start_s=t0 - self.origin, segments=[(t0 - self.origin, wall)])
        return result, outcome or StageOutcome(), t0 - self.origin

    def _fail(self, ctx: HookContext, stage: str, exc: Exception, wall: float, start: float) -> None:
        self._failed.append(
            StageRecord(
                hook=ctx.hook, stage=stage, rank=ctx.rank, status="failed",
                reason=f"{type(exc).__name__}: {exc}", wall_s=wall, start_s=start,
            )
        )
        exc.add_note(f"[accelerate_memsafe] raised in stage `{stage}` at hook `{ctx.hook}` on rank {ctx.rank}")

    def run(self, ctx: HookContext, upstream: Callable[[HookContext], Any]) -> Any:
        """Settles the work the previous hook left in the background (rank 0's checkpoint commit, see
        :class:`~accelerate_memsafe.background.BackgroundWork`; its error is raised here, on every rank), then runs
        the stages of ``ctx.hook``, then ``upstream`` (accelerate's own method), then the stages' ``after`` parts
        in reverse order.

        In a multi-process run an error on one rank reaches every rank within seconds: the failing rank
        publishes it in the process group's store before re-raising it, and the other ranks, waiting in a
        stage's collective or at one of the two agreement points (after the last stage, before accelerate's
        call; at the end of the hook), raise :class:`~accelerate_memsafe.errors.PeerStageError` naming the
        stage, the rank and its message.

        Returns:
            What ``upstream`` returned, or ``ctx.result`` when a stage replaced the upstream call.

        Raises:
            PeerStageError: If another rank failed during this hook call.
            CheckpointError: If the previous hook's background commit failed.
        """

        if ctx.world_size == 1 and not self.probe_hooks_without_stages:
            skipped = self._every_stage_skips(ctx)
            if skipped is not None:
                return self._run_upstream_alone(ctx, upstream, skipped)

        def call_upstream(c: HookContext) -> None:
            c.result = upstream(c)

        self._failed: list[StageRecord] = []
        self._skips: list[StageRecord] = []
        done: list[list[Any]] = []
        upstream_entry: list[Any] | None = None
        timeout_s = getattr(ctx.options, "collective_timeout_s", None) or 600.0
        current = "pipeline"
        # one process has no peer to tell (`hook_scope` yields None there)
        scoped = hook_scope(ctx.hook, rank=ctx.rank, world_size=ctx.world_size) if ctx.world_size > 1 else None
        with scoped or contextlib.nullcontext() as scope:
            peers = scope is not None or ctx.world_size > 1
            try:
                if scope is not None:
                    check_not_abandoned()
                # the previous hook's background commit ends before anything here can read or replace checkpoints
                current = "background commit"
                self.background.settle(rank=ctx.rank, world_size=ctx.world_size, timeout_s=timeout_s)
                ctx.background = self.background
                # the stages run with Python's cyclic collector paused: a full collection (a third of a second for
                # a transformers process's 400 000 objects on a busy machine) falls where the allocation counts
                # say, and inside a stage it stalls every rank waiting in the stage's collectives
                with gc_paused():
                    # with peers, the preflight's exchange comes first, on every rank alike; in one process it waits
                    # for the first stage that runs (before it, as ever): where every stage skips (a single process's
                    # `prepare`) its announcements and estimates would serve nothing
                    preflight_due = peers
                    if preflight_due:
                        current = "preflight"
                        with walk.frozen(ctx.model):  # the look: one walk of the tree serves every check
                            self._preflight(ctx)
                    walk.thaw(ctx.model)  # the look ends here, also where the caller froze it: the stages change the tree
                    stages = self.stages.get(ctx.hook, ())
                    fixed = self._fixed_reasons(ctx)
                    for stage, reason in zip(stages, fixed):
                        current = stage.name
                        try:
                            if reason is None:
                                reason = stage.skip_reason(ctx)
                        except Exception as exc:
                            self._fail(ctx, stage.name, exc, 0.0, time.perf_counter() - self.origin)
                            raise
                        if reason is not None:
                            self._skips.append(self._skip_record(ctx, stage.name, reason))
                            continue
                        if not preflight_due:
                            current, preflight_due = "preflight", True
                            with walk.frozen(ctx.model):
                                self._preflight(ctx)
                            current = stage.name
                        result, outcome, start = self._probe(ctx, stage.run, stage.name)
                        done.append([stage.name, result, outcome, start, stage])
                current = "pipeline"
                if scope is not None:
                    # a rank whose stages are done must not enter accelerate's own collectives (which cannot
                    # be interrupted) while a peer has failed
                    scope.agree(f"before `accelerate.{ctx.hook}`", timeout_s=timeout_s)
                if ctx.skip_upstream is None:
                    current = f"accelerate.{ctx.hook}"
                    # in one process, where no stage ran (its `prepare`), accelerate's call is all the hook is, and
                    # is timed only: reading memory around it would cost a call of a few milliseconds a tenth of its wall
                    if done or self.probe_hooks_without_stages or peers:
                        result, outcome, start = self._probe(ctx, call_upstream, current)
                    else:
                        result, outcome, start = self._time(ctx, call_upstream, current)
                        outcome.details["memory_measured"] = False
                    upstream_entry = [current, result, outcome, start, None]
                with gc_paused():
                    for entry in reversed(done):
                        stage, outcome = entry[4], entry[2]
                        if outcome.status == "ran" and type(stage).after is not Stage.after:
                            current = stage.name
                            result2, outcome2, _ = self._probe(ctx, stage.after, stage.name)
                            entry[1] = _merge(entry[1], result2)
                            outcome.details.update(outcome2.details)
                current = "pipeline"
                if scope is not None:
                    # no rank returns to the training loop's collectives while a peer failed late in the hook
                    scope.agree(f"at the end of hook `{ctx.hook}`", timeout_s=timeout_s)
            except BaseException as exc:
                if scope is not None and not isinstance(exc, PeerStageError):
                    scope.publish(current, exc)
                raise
            finally:
                entries = done + ([upstream_entry] if upstream_entry else [])
                records = [self._make_record(ctx, *e[:4]) for e in entries] + self._failed + self._skips
                for record in sorted(records, key=lambda r: r.start_s):
                    self.report.add(record)
        return ctx.result

    def _every_stage_skips(self, ctx: HookContext) -> tuple[tuple[str, str], ...] | None:
        """``(stage, reason)`` of every stage of the hook when each skips this call (``None``: one runs, or a
        :meth:`Stage.skip_reason` raised, which :meth:`run` then records as it does everywhere)."""
        fixed = self._fixed_reasons(ctx)
        pairs = []
        for stage, reason in zip(self.stages.get(ctx.hook, ()), fixed):
            if reason is None:
                try:
                    reason = stage.skip_reason(ctx)
                except Exception:
                    return None
                if reason is None:
                    return None
            pairs.append((stage.name, reason))
        return tuple(pairs)

    def _run_upstream_alone(self, ctx: HookContext, upstream: Callable[[HookContext], Any],
                            skipped: tuple[tuple[str, str], ...]) -> Any:
        """:meth:`run` of a one-process hook call in which every stage skips: the previous hook's background commit
        settled, then accelerate's own call, timed (no memory reading: a few milliseconds' call would pay a tenth of
        its wall for it), and the same records :meth:`run` would add, made when the report is first read."""
        background = ctx.background = self.background
        if background.pending is not None:
            background.settle(rank=ctx.rank, world_size=1,
                              timeout_s=getattr(ctx.options, "collective_timeout_s", None) or 600.0)
        walk.thaw(ctx.model)  # as :meth:`run` does before the stages
        t0 = time.perf_counter()
        try:
            ctx.result = upstream(ctx)
        except Exception as exc:
            self._failed = []
            self._fail(ctx, f"accelerate.{ctx.hook}", exc, time.perf_counter() - t0, t0 - self.origin)
            for stage, reason in skipped:
                self.report.add(self._skip_record(ctx, stage, reason, start_s=t0 - self.origin))
            self.report.add(self._failed[0])
            raise
        wall = time.perf_counter() - t0
        self.report.add_unprobed(ctx.hook, ctx.rank, skipped, t0 - self.origin, f"accelerate.{ctx.hook}",
                                 t0 - self.origin, wall)
        return ctx.result

    def _fixed_reasons(self, ctx: HookContext) -> tuple[str | None, ...]:
        """Each stage's :meth:`Stage.fixed_skip_reason` for the hook, world size and FSDP2-or-not of ``ctx``, in stage
        order, asked once and kept (``None`` where it raised: :meth:`Stage.skip_reason` is then asked at every call,
        and its error recorded as a failure of the stage)."""
        key = (ctx.hook, ctx.world_size, ctx.is_fsdp2)
        reasons = self._fixed.get(key)
        if reasons is None:
            self._fixed[key] = reasons = tuple(_fixed_skip_reason(s, ctx) for s in self.stages.get(ctx.hook, ()))
        return reasons

    def _preflight(self, ctx: HookContext) -> None:
        """Checks every stage's estimate before any stage runs, and hands the stages what every rank announced
        (:meth:`Stage.announce`). The ranks exchange their estimates, limits and announcements once, so every rank
        reaches the same verdict (one rank refusing never leaves the others waiting in a collective), and ranks
        that share a CPU limit are checked against it together. Whether the exchange happens depends on the stages
        and the options only (the same on every rank), never on what a rank found. A stage whose estimate waits for
        the announcements (:meth:`Stage.needs_estimate`) is asked after the exchange, and its figures take a second
        exchange only where some such stage needs one (decided from the announcements: the same on every rank)."""
        options = ctx.options
        if options is None:
            return
        hook_stages = self.stages.get(ctx.hook, ())
        announcing = [s for s in hook_stages if type(s).announce is not Stage.announce]
        announced = {s.name: s.announce(ctx) for s in announcing}
        check = bool(getattr(options, "preflight_memory_check", False))
        stages = [s for s in hook_stages if check and type(s).estimate is not Stage.estimate]
        if not stages and not announcing:
            return
        # a stage that decides from the announcements whether it needs an estimate is asked after the exchange
        later = [s for s in stages if type(s).needs_estimate is not Stage.needs_estimate]
        estimates = {}
        for stage in stages:
            if stage not in later:
                est = stage.estimate(ctx)
                if est is not None:
                    estimates[stage.name] = est
        ctx.scratch.setdefault("estimates", {}).update(estimates)
        ctx.scratch[ANNOUNCED_KEY] = {name: [value] for name, value in announced.items()}
        import torch.distributed as dist

        peers = ctx.world_size > 1 and dist.is_available() and dist.is_initialized()
        if not peers:  # one process: the stages that wait for the announcements decide on this one's alone
            for stage in later:
                est = stage.estimate(ctx) if stage.needs_estimate(ctx) else None
                if est is not None:
                    estimates[stage.name] = est
            ctx.scratch["estimates"].update(estimates)
            later = []
            if not estimates:
                return  # nothing to check, and no peer to exchange with
        mine = None
        if stages:
            limit, dev_free = available_memory(ctx.device)
            mine = RankBudget(ctx.rank, limit.key, limit.available, limit.source, dev_free, estimates)
        budgets = [mine]
        if peers:
            from .distributed.collectives import exchange_objects

            everyone = exchange_objects((mine, announced), stage="preflight", timeout_s=options.collective_timeout_s,
                                        what="exchange of the preflight memory estimates and the stages' announcements")
            budgets = [budget for budget, _ in everyone]
            ctx.scratch[ANNOUNCED_KEY] = {name: [theirs[name] for _, theirs in everyone] for name in announced}
        later = [s for s in later if s.needs_estimate(ctx)]  # the same stages on every rank
        if later:
            more = {}
            for stage in later:
                est = stage.estimate(ctx)
                if est is not None:
                    more[stage.name] = est
            ctx.scratch["estimates"].update(more)
            theirs = exchange_objects(  # `later` is left empty in one process: there are peers here
                more, stage="preflight", timeout_s=options.collective_timeout_s,
                what="exchange of the memory estimates that waited for the announcements")
            budgets = [dataclasses.replace(b, estimates={**b.estimates, **t}) for b, t in zip(budgets, theirs)]
        if not stages:
            return
        from .env import launch_env

        problems = budget_problems(ctx.hook, budgets, local_world_size=launch_env().local_world_size)
        if problems:
            from .errors import MemoryBudgetError

            raise MemoryBudgetError(
                f"preflight memory check failed before hook `{ctx.hook}` started: {' | '.join(problems)}. Nothing "
                "was changed. Free memory, use more nodes or fewer processes per node, a smaller `bucket_bytes`, or "
                "disable the check with `MemSafePlugin(preflight_memory_check=False)`."
            )

    def _skip_record(self, ctx: HookContext, name: str, reason: str, *, start_s: float | None = None) -> StageRecord:
        """The record of a stage whose :meth:`Stage.skip_reason` said it does not apply: the reason only. No
        probe ran, so it has no wall time, memory figure, timeline or time span (``segments`` is empty); it is stamped
        ``start_s`` (default: now)."""
        return StageRecord(hook=ctx.hook, stage=name, rank=ctx.rank, status="skipped", reason=reason, wall_s=0.0,
                           start_s=time.perf_counter() - self.origin if start_s is None else start_s)

    def _make_record(
        self, ctx: HookContext, name: str, result: ProbeResult, outcome: StageOutcome, start: float
    ) -> StageRecord:
        return StageRecord(
            hook=ctx.hook,
            stage=name,
            rank=ctx.rank,
            status=outcome.status,
            reason=outcome.reason,
            wall_s=result.wall_s,
            cpu_rss_peak_bytes=result.cpu_rss_peak_bytes,
            cpu_rss_delta_bytes=result.cpu_rss_delta_bytes,
            cpu_anon_peak_bytes=result.cpu_anon_peak_bytes,
            cpu_anon_delta_bytes=result.cpu_anon_delta_bytes,
            device_peak_bytes=result.device_peak_bytes,
            device_delta_bytes=result.device_delta_bytes,
            live_tensor_peak_bytes=result.live_tensor_peak_bytes,
            cpu_rss_start_bytes=result.cpu_rss_start_bytes,
            cpu_anon_start_bytes=result.cpu_anon_start_bytes,
            start_s=result.segments[0][0] if result.segments else start,
            segments=[list(seg) for seg in result.segments],
            details=dict(outcome.details),
            timeline=[[s.t, s.rss, s.anon] for s in result.timeline],
        )
