"""The probe that wraps every stage run: wall time, CPU RSS/RssAnon peaks, device peaks, live tensors."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import torch

from .procfs import read_proc_memory, reset_peak_rss
from .tracker import LiveTensorTracker

#: Sampling interval of the RSS thread. 2 ms catches transient peaks of a few hundred MB at memcpy speed.
SAMPLE_INTERVAL_S = 0.002


@dataclass
class Sample:
    """A point of the memory timeline (seconds since the report's origin, bytes)."""

    t: float
    rss: int
    anon: int


@dataclass
class ProbeResult:
    """What one probed region measured. Peaks are absolute; deltas are end minus start."""

    wall_s: float
    cpu_rss_start_bytes: int | None
    cpu_rss_peak_bytes: int | None
    cpu_rss_delta_bytes: int | None
    cpu_anon_start_bytes: int | None
    cpu_anon_peak_bytes: int | None
    cpu_anon_delta_bytes: int | None
    device_peak_bytes: int | None
    device_delta_bytes: int | None
    live_tensor_peak_bytes: int | None
    timeline: list[Sample] = field(default_factory=list)


def _device_module(device: torch.device | None):
    if device is None or device.type in ("cpu", "meta"):
        return None
    mod = getattr(torch, device.type, None)
    if mod is None or not hasattr(mod, "max_memory_allocated"):
        return None
    return mod


class MemoryProbe:
    """Measures one region of code. Use as a context manager; read :attr:`result` afterwards.

    Args:
        device: The accelerator device whose allocator peaks are read (``None`` or CPU: not measured).
        track_tensors: Whether to run the dispatch-level :class:`LiveTensorTracker` inside the region.
        origin: ``time.perf_counter()`` value that timeline samples are relative to.

    Example:
        >>> with MemoryProbe() as probe:
        ...     x = torch.zeros(1 << 20)
        >>> probe.result.wall_s > 0
        True
    """

    def __init__(self, device: torch.device | None = None, *, track_tensors: bool = True, origin: float | None = None):
        self.device = device
        self.track_tensors = track_tensors
        self.origin = time.perf_counter() if origin is None else origin
        self.result: ProbeResult | None = None
        self._stop = threading.Event()
        self._samples: list[Sample] = []
        self._thread: threading.Thread | None = None
        self._tracker: LiveTensorTracker | None = None

    def _sample(self) -> None:
        mem = read_proc_memory()
        if mem is not None:
            self._samples.append(Sample(time.perf_counter() - self.origin, mem.rss, mem.anon))

    def _run_sampler(self) -> None:
        while not self._stop.wait(SAMPLE_INTERVAL_S):
            self._sample()

    def __enter__(self) -> MemoryProbe:
        self._hwm_reset = reset_peak_rss()
        self._start_mem = read_proc_memory()
        self._sample()
        self._dev = _device_module(self.device)
        if self._dev is not None:
            self._dev.synchronize()
            self._dev_start = self._dev.memory_allocated()
            self._dev.reset_peak_memory_stats()
        self._thread = threading.Thread(target=self._run_sampler, name="memsafe-probe", daemon=True)
        self._thread.start()
        if self.track_tensors:
            self._tracker = LiveTensorTracker()
            self._tracker.__enter__()
        self._t0 = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        wall = time.perf_counter() - self._t0
        if self._tracker is not None:
            self._tracker.__exit__(*exc)
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self._sample()
        end = read_proc_memory()
        start = self._start_mem
        rss_peak = anon_peak = None
        if self._samples:
            rss_peak = max(s.rss for s in self._samples)
            anon_peak = max(s.anon for s in self._samples)
            if end is not None and self._hwm_reset:
                rss_peak = max(rss_peak, end.hwm)
        dev_peak = dev_delta = None
        if self._dev is not None:
            self._dev.synchronize()
            dev_peak = self._dev.max_memory_allocated()
            dev_delta = self._dev.memory_allocated() - self._dev_start
        self.result = ProbeResult(
            wall_s=wall,
            cpu_rss_start_bytes=start.rss if start else None,
            cpu_rss_peak_bytes=rss_peak,
            cpu_rss_delta_bytes=(end.rss - start.rss) if (start and end) else None,
            cpu_anon_start_bytes=start.anon if start else None,
            cpu_anon_peak_bytes=anon_peak,
            cpu_anon_delta_bytes=(end.anon - start.anon) if (start and end) else None,
            device_peak_bytes=dev_peak,
            device_delta_bytes=dev_delta,
            live_tensor_peak_bytes=self._tracker.peak_bytes if self._tracker is not None else None,
            timeline=self._samples[:: max(1, len(self._samples) // 200)],
        )
