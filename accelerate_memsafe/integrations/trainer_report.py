"""The one-line summary of what the plugin did for a Trainer run, from its records."""

from __future__ import annotations

from ..memory.report import MemoryReport


def _mib(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**20:.1f} MiB"


def summary_line(report: MemoryReport, *, rank: int, report_path: str | None = None) -> str:
    """Summarises one rank's records: the ``prepare`` stages that ran (time, peak RssAnon), the checkpoints
    committed atomically (and rotated out), the CPU-first reloads, and where the report is written.

    Example:
        >>> from accelerate_memsafe.memory.report import StageRecord
        >>> r = MemoryReport([StageRecord("prepare", "shard", 0, "ran", None, 0.5, cpu_anon_peak_bytes=2**20)])
        >>> summary_line(r, rank=0)
        'accelerate_memsafe (rank 0): prepare ran shard (0.50 s, peak RssAnon 1.0 MiB); no checkpoint saved; no reload'
    """
    mine = [r for r in report.records if r.rank == rank]
    prepared = [r for r in mine if r.hook == "prepare" and r.status == "ran"]
    stages = list(dict.fromkeys(r.stage for r in prepared if not r.stage.startswith("accelerate.")))
    peaks = [r.cpu_anon_peak_bytes for r in prepared if r.cpu_anon_peak_bytes is not None]
    parts = []
    if stages:
        parts.append(f"prepare ran {', '.join(stages)} ({sum(r.wall_s for r in prepared):.2f} s, "
                     f"peak RssAnon {_mib(max(peaks) if peaks else None)})")
    else:
        parts.append("no prepare stage ran")
    saves = [r for r in mine if r.hook == "save_state" and r.stage == "atomic_checkpoint" and r.status == "ran"]
    if saves:
        last = saves[-1].details.get("final")
        rotated = sum(len(r.details.get("deleted") or ()) for r in saves)
        parts.append(f"{len(saves)} checkpoint(s) saved atomically (last {last}"
                     + (f", {rotated} rotated out after the new one was complete" if rotated else "") + ")")
    else:
        parts.append("no checkpoint saved")
    reloads = [r for r in mine if r.hook == "load_state" and r.status == "ran" and not r.stage.startswith(("accelerate.", "transformers."))]
    if reloads:
        counts: dict[str, int] = {}
        for r in reloads:
            counts[r.stage] = counts.get(r.stage, 0) + 1
        parts.append("CPU-first reloads: " + ", ".join(f"{k} x{v}" for k, v in counts.items()))
    else:
        parts.append("no reload")
    if report_path:
        parts.append(f"report: {report_path.replace('{rank}', str(rank))}")
    return f"accelerate_memsafe (rank {rank}): " + "; ".join(parts)
