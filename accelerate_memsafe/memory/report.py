"""Stage records and the :class:`MemoryReport`: data first (dict/JSON), then a markdown table."""

from __future__ import annotations

import json
import os
from collections import deque
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

#: Keys every record carries (the public schema of ``MemoryReport.to_dict()["records"]``).
RECORD_KEYS = (
    "hook",
    "stage",
    "rank",
    "status",
    "reason",
    "wall_s",
    "cpu_rss_peak_bytes",
    "cpu_rss_delta_bytes",
    "cpu_anon_peak_bytes",
    "cpu_anon_delta_bytes",
    "device_peak_bytes",
    "device_delta_bytes",
    "live_tensor_peak_bytes",
)

#: Timeline samples a :class:`MemoryReport` keeps over all its records (about 17 MB as Python lists). A probe keeps
#: fewer than 400, so this holds the timelines of the last several hundred stages; older records keep
#: every figure but lose their ``timeline`` (``timelines_dropped`` counts them). A run that saves every few steps
#: for days adds a few records per save; their timelines, most of a record's size and most of the objects Python's
#: collector walks in it, must not grow without bound.
MAX_TIMELINE_SAMPLES = 100_000


@dataclass
class StageRecord:
    """What one stage did on one rank at one hook point.

    ``status`` is ``"ran"``, ``"skipped"`` (``reason`` says why) or ``"failed"``. ``details`` holds
    stage-specific figures (bytes sent, buffers verified, ...). ``timeline`` holds ``[t, rss, anon]``
    samples for plots (``t`` in seconds since the plugin was created, like ``start_s``). ``segments`` holds
    ``[start_s, wall_s]`` of each part of the stage's run: one, or two for a stage with an ``after`` part
    (run before accelerate's call and after it); ``wall_s`` is their sum, and every sample lies within one
    of them. A stage skipped before it ran (its ``skip_reason``) was not probed: ``wall_s`` 0, no figures, no
    timeline, no segments (:attr:`measured` is ``False``), only ``reason``.
    """

    hook: str
    stage: str
    rank: int
    status: str
    reason: str | None
    wall_s: float
    cpu_rss_peak_bytes: int | None = None
    cpu_rss_delta_bytes: int | None = None
    cpu_anon_peak_bytes: int | None = None
    cpu_anon_delta_bytes: int | None = None
    device_peak_bytes: int | None = None
    device_delta_bytes: int | None = None
    live_tensor_peak_bytes: int | None = None
    cpu_rss_start_bytes: int | None = None
    cpu_anon_start_bytes: int | None = None
    start_s: float = 0.0
    details: dict[str, Any] = field(default_factory=dict)
    timeline: list[list[float]] = field(default_factory=list)
    segments: list[list[float]] = field(default_factory=list)

    def spans(self) -> list[tuple[float, float]]:
        """``(start, end)`` of each part of the stage's run, in seconds (``[start_s, start_s + wall_s]`` for a
        record without ``segments``).

        Example:
            >>> StageRecord("save_state", "s", 0, "ran", None, 0.5, start_s=1.0, segments=[[1.0, 0.2], [2.0, 0.3]]).spans()
            [(1.0, 1.2), (2.0, 2.3)]
        """
        parts = self.segments or [[self.start_s, self.wall_s]]
        return [(float(start), float(start) + float(wall)) for start, wall in parts]

    @property
    def measured(self) -> bool:
        """Whether a probe measured this record: ``False`` for a stage skipped before it ran (its ``wall_s`` of 0
        and its empty figures are not measurements; ``reason`` says why it did not run)."""
        return self.status != "skipped" or bool(self.segments) or self.wall_s > 0

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> StageRecord:
        known = {k: v for k, v in data.items() if k in cls.__dataclass_fields__}
        return cls(**known)


def _mib(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**20:,.1f}"


class MemoryReport:
    """The per-stage memory and time records of a run, and ``not_measured``: the record fields that no record
    measures in this run, each with why (e.g. ``live_tensor_peak_bytes`` when the live-tensor tracker is off).

    Records added one by one (:meth:`add`, as the pipeline does) keep their timelines up to
    ``max_timeline_samples`` samples in all: beyond it the oldest records' timelines are emptied, their figures
    kept, and ``timelines_dropped`` counts them (``None``: no bound).

    Example:
        >>> report = MemoryReport()
        >>> report.to_dict()
        {'records': []}
    """

    def __init__(self, records: list[StageRecord] | None = None, not_measured: dict[str, str] | None = None, *,
                 max_timeline_samples: int | None = MAX_TIMELINE_SAMPLES, timelines_dropped: int = 0) -> None:
        self._records: list[StageRecord] = list(records or [])
        self._deferred: list[tuple] = []  # calls added by `add_unprobed`, made into records when first read
        self.not_measured: dict[str, str] = dict(not_measured or {})
        self.max_timeline_samples = max_timeline_samples
        self.timelines_dropped = timelines_dropped
        self._kept: deque[StageRecord] = deque()  # records added with a timeline, oldest first
        self._kept_samples = 0

    @property
    def records(self) -> list[StageRecord]:
        """Every record, in the order they were added."""
        if self._deferred:
            self._make_deferred()
        return self._records

    @records.setter
    def records(self, records: list[StageRecord]) -> None:
        self._deferred.clear()
        self._records = records

    def add_unprobed(self, hook: str, rank: int, skipped: tuple[tuple[str, str], ...], skipped_at: float, upstream: str,
                     start_s: float, wall_s: float) -> None:
        """Adds the records of a hook call in which every stage was skipped and accelerate's own call (``upstream``,
        ``"accelerate.prepare"``) was timed, not probed: one ``skipped`` record per ``(stage, reason)``, stamped
        ``skipped_at``, then the call's (``details={"memory_measured": False}``). The same records :meth:`add` would
        take, made when the records are first read: a one-process ``prepare`` adds them without building any.

        Example:
            >>> report = MemoryReport()
            >>> report.add_unprobed("prepare", 0, (("shard", "not an FSDP2 run"),), 1.0, "accelerate.prepare", 1.5, 0.25)
            >>> [(r.stage, r.status, r.wall_s, r.segments) for r in report.records]
            [('shard', 'skipped', 0.0, []), ('accelerate.prepare', 'ran', 0.25, [[1.5, 0.25]])]
        """
        self._deferred.append((hook, rank, skipped, skipped_at, upstream, start_s, wall_s))

    def _make_deferred(self) -> None:
        deferred, self._deferred = self._deferred, []
        for hook, rank, skipped, skipped_at, upstream, start_s, wall_s in deferred:
            for stage, reason in skipped:
                self._records.append(StageRecord(hook=hook, stage=stage, rank=rank, status="skipped", reason=reason,
                                                 wall_s=0.0, start_s=skipped_at))
            self._records.append(StageRecord(hook=hook, stage=upstream, rank=rank, status="ran", reason=None,
                                             wall_s=wall_s, start_s=start_s, segments=[[start_s, wall_s]],
                                             details={"memory_measured": False}))

    def add(self, record: StageRecord) -> None:
        """Appends one record; empties the timelines of the oldest ones when the report holds more than
        ``max_timeline_samples`` samples (never the newest record's).

        Example:
            >>> report = MemoryReport(max_timeline_samples=3)
            >>> for i in range(3):
            ...     report.add(StageRecord("save_state", "s", 0, "ran", None, 0.1, timeline=[[i, 1, 1], [i, 2, 2]]))
            >>> [len(r.timeline) for r in report.records], report.timelines_dropped
            ([0, 0, 2], 2)
        """
        records = self.records  # the deferred ones first, in their order
        records.append(record)
        if not record.timeline or self.max_timeline_samples is None:
            return
        self._kept.append(record)
        self._kept_samples += len(record.timeline)
        while self._kept_samples > self.max_timeline_samples and len(self._kept) > 1:
            old = self._kept.popleft()
            self._kept_samples -= len(old.timeline)
            old.timeline = []
            self.timelines_dropped += 1

    def find(self, *, hook: str | None = None, stage: str | None = None, rank: int | None = None) -> list[StageRecord]:
        """Returns the records matching every given field."""
        return [
            r
            for r in self.records
            if (hook is None or r.hook == hook) and (stage is None or r.stage == stage) and (rank is None or r.rank == rank)
        ]

    def to_dict(self, *, timeline: bool = True) -> dict[str, Any]:
        """Returns ``{"records": [...]}``, one plain dict per record (JSON-serialisable)."""
        out = []
        for r in self.records:
            d = asdict(r)
            if not timeline:
                d.pop("timeline")
            out.append(d)
        return {"records": out, **({"not_measured": dict(self.not_measured)} if self.not_measured else {}),
                **({"timelines_dropped": self.timelines_dropped} if self.timelines_dropped else {})}

    def to_json(self, path: str | os.PathLike) -> Path:
        """Writes :meth:`to_dict` to ``path`` (atomically: a temporary file renamed into place)."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
        tmp.write_text(json.dumps(self.to_dict(), indent=1))
        os.replace(tmp, path)
        return path

    @classmethod
    def from_json(cls, path: str | os.PathLike) -> MemoryReport:
        """Reads a report written by :meth:`to_json`.

        Raises:
            ValueError: If the file is not a report (no ``records`` list).
        """
        data = json.loads(Path(path).read_text())
        if not isinstance(data, dict) or not isinstance(data.get("records"), list):
            raise ValueError(f"{path} is not a memsafe report: expected a JSON object with a 'records' list.")
        dropped = data.get("timelines_dropped", 0)
        if not isinstance(dropped, int) or dropped < 0:
            raise ValueError(f"{path} is not a memsafe report: 'timelines_dropped' is {dropped!r}, not a count.")
        return cls([StageRecord.from_dict(r) for r in data["records"]], data.get("not_measured"), timelines_dropped=dropped)

    def to_markdown(self) -> str:
        """Renders the records as a markdown table (MiB figures, one row per hook/stage/rank)."""
        header = (
            "| hook | stage | rank | status | wall s | RSS peak MiB | RSS Δ MiB | anon peak MiB | anon Δ MiB "
            "| device peak MiB | live tensors peak MiB | note |"
        )
        lines = [header, "|" + "---|" * 12]
        for r in self.records:
            note = r.reason or ", ".join(f"{k}={v}" for k, v in r.details.items() if not isinstance(v, (dict, list)))
            lines.append(
                f"| {r.hook} | {r.stage} | {r.rank} | {r.status} | {f'{r.wall_s:.3f}' if r.measured else '-'} "
                f"| {_mib(r.cpu_rss_peak_bytes)} "
                f"| {_mib(r.cpu_rss_delta_bytes)} | {_mib(r.cpu_anon_peak_bytes)} | {_mib(r.cpu_anon_delta_bytes)} "
                f"| {_mib(r.device_peak_bytes)} | {_mib(r.live_tensor_peak_bytes)} | {note} |"
            )
        lines += [f"\nNot measured: `{key}`: {why}" for key, why in self.not_measured.items()]
        return "\n".join(lines)

    def gather(self) -> MemoryReport:
        """Collects every rank's records (a collective: call it on every rank).

        Returns:
            A new report holding the records of all ranks, sorted by rank then time. Without an
            initialised process group, a copy of this report.
        """
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return MemoryReport(list(self.records), self.not_measured, timelines_dropped=self.timelines_dropped)
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, self.to_dict())
        records = [StageRecord.from_dict(r) for part in gathered for r in part["records"]]
        records.sort(key=lambda r: (r.rank, r.start_s))
        return MemoryReport(records, {k: v for part in gathered for k, v in part.get("not_measured", {}).items()},
                            timelines_dropped=sum(part.get("timelines_dropped", 0) for part in gathered))

    def __len__(self) -> int:
        return len(self.records)

    def __repr__(self) -> str:
        return f"MemoryReport({len(self.records)} records)"
