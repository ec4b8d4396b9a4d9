"""The probe that wraps every stage run: wall time, CPU RSS/RssAnon peaks, device peaks, live tensors.

The device peak is measured without touching the allocator's peak statistics: the user's own
``torch.cuda.max_memory_allocated()`` (which ``transformers.Trainer`` logs) must not be lowered by a
``reset_peak_memory_stats()`` around every stage. A region's device peak is therefore the largest of

- ``memory_allocated()`` at the start and at the end,
- ``memory_allocated()`` as sampled by the probe's thread (every ``interval_s``), and
- the allocator's ``max_memory_allocated()`` at the end, *if* it rose during the region (a new high-water
  mark was set inside the region, so it is the region's exact peak).

When the region stayed below an earlier high-water mark, a transient peak shorter than the sampling
interval can be missed; the figure is then a lower bound.

The CPU RSS peak follows the same rule with the kernel's ``VmHWM`` (read as ``getrusage``'s ``ru_maxrss``), which
the probe never resets (a reset through ``/proc/self/clear_refs`` would lower the figure the user's own tools read):
the sampled peak, raised to the high-water mark when it rose during the region.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass, field

import torch

from .procfs import malloc_trim, read_probe_memory, read_rss_anon
from .tracker import LiveTensorTracker

#: Default sampling interval of a probe made directly. 2 ms catches transient peaks of a few hundred MB at memcpy
#: speed; each sample costs the sampled process CPU time and a hand-off of the GIL, so the plugin's stages sample
#: every ``MemSafePlugin(memory_sample_interval_s=...)`` (10 ms by default).
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
    start_s: float = 0.0
    """When the region started (seconds since the probe's origin)."""
    segments: list[tuple[float, float]] = field(default_factory=list)
    """``(start_s, wall_s)`` of each measured region: one for a probe, several for a stage whose parts ran
    at different times (:func:`~accelerate_memsafe.pipeline.Pipeline.run` merges a stage's ``after`` part
    into its record). Every timeline sample lies inside one of them."""


def _device_index(mod, device: torch.device) -> torch.device:
    """``device`` with an explicit index: the sampling thread does not share the caller's current device."""
    if device.index is not None or not hasattr(mod, "current_device"):
        return device
    try:
        return torch.device(device.type, mod.current_device())
    except Exception:  # pragma: no cover - backends without a notion of current device
        return device


def _allocated(mod, device: torch.device) -> int:
    try:
        return int(mod.memory_allocated(device))
    except TypeError:  # pragma: no cover - backends whose memory_allocated takes no device
        return int(mod.memory_allocated())


def _max_allocated(mod, device: torch.device) -> int:
    try:
        return int(mod.max_memory_allocated(device))
    except TypeError:  # pragma: no cover
        return int(mod.max_memory_allocated())


def _device_module(device: torch.device | None):
    if device is None or device.type in ("cpu", "meta"):
        return None
    mod = getattr(torch, device.type, None)
    if mod is None or not hasattr(mod, "max_memory_allocated"):
        return None
    return mod


class _Sampler:
    """One daemon thread per process samples RSS/RssAnon (and device memory) for every open probe, at the
    shortest ``interval_s`` of the open probes, and sleeps on a condition while none is open: a probe costs no
    thread start or join (each is a scheduler round trip, milliseconds on a busy machine, on every stage).

    The thread is woken once for a run of probes, not once per probe: the first probe opened while it is idle wakes it;
    it then takes its first sample one interval later (the probe's own first reading is the sample at its start) and
    keeps sampling every interval while a probe is open, going idle at the first wake that finds none. A hook's short
    stages, one after the other, thus wake it once (each wake is a hand-off of the GIL, and on a machine whose cores
    are all busy a wait for the scheduler too), and a training loop between hooks is never woken."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._probes: list[MemoryProbe] = []
        self._thread: threading.Thread | None = None
        self._pid = 0
        self._active = False  # the thread is sampling (or about to): a new probe needs no wake
        self.wakes = 0  # times a probe woke the idle thread (what the tests count)

    def start(self) -> None:
        """Starts the thread if this process has none yet (it sleeps until a probe opens)."""
        with self._cond:
            self._start()

    def _start(self) -> None:
        if self._thread is None or self._pid != os.getpid() or not self._thread.is_alive():
            self._pid = os.getpid()  # a forked child has no copy of the parent's thread
            self._thread = threading.Thread(target=self._run, name="memsafe-probe", daemon=True)
            self._thread.start()

    def add(self, probe: MemoryProbe) -> None:
        with self._cond:
            self._start()
            self._probes.append(probe)
            if not self._active:
                self._active = True
                self.wakes += 1
                self._cond.notify()

    def remove(self, probe: MemoryProbe) -> None:
        """Once this returns, the thread adds nothing more to ``probe``."""
        with self._cond:
            self._probes.remove(probe)

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._active:
                    self._cond.wait()
                interval = min((probe.interval_s for probe in self._probes), default=SAMPLE_INTERVAL_S)
            time.sleep(interval)
            with self._cond:
                if not self._probes:  # every probe closed since: idle until the next one opens
                    self._active = False
                    continue
            mem = read_rss_anon()
            t = time.perf_counter()
            with self._cond:
                for probe in self._probes:
                    probe._take(t, mem)


_SAMPLER = _Sampler()


def start_sampler() -> None:
    """Starts the probes' sampling thread now, off any stage's path (a thread start is a scheduler round trip,
    milliseconds on a busy machine), and takes the process's first reading of its memory counters, which opens
    ``/proc/self/statm`` for the process's later reads (half a millisecond in the first probe of a hook otherwise):
    called when a memsafe accelerator is built."""
    _SAMPLER.start()
    read_probe_memory()


class MemoryProbe:
    """Measures one region of code. Use as a context manager; read :attr:`result` afterwards.

    Args:
        device: The accelerator device whose allocator peaks are read (``None`` or CPU: not measured).
        track_tensors: Whether to run the dispatch-level :class:`LiveTensorTracker` inside the region.
        origin: ``time.perf_counter()`` value that timeline samples are relative to.
        interval_s: Seconds between two samples of RSS/RssAnon (and device memory) inside the region.
        trim_heap: Hand glibc's freed heap back to the kernel (``malloc_trim``) before the region starts, so that its
            start and peaks count only what is alive. Off by default, and never done around the plugin's stages: the
            memory glibc keeps is what the process holds in the kernel's eyes (and what its next allocations reuse
            without a page fault); trimming it before every stage made a second ``prepare`` in one process
            take twice as long as stock's, and each ``save_state`` hand the training loop's freed heap back, to be
            faulted in again by the next step.

    Example:
        >>> with MemoryProbe() as probe:
        ...     x = torch.zeros(1 << 20)
        >>> probe.result.wall_s > 0
        True
    """

    def __init__(self, device: torch.device | None = None, *, track_tensors: bool = True, origin: float | None = None,
                 trim_heap: bool = False, interval_s: float = SAMPLE_INTERVAL_S):
        self.device = device
        self.interval_s = interval_s
        self.trim_heap = trim_heap
        self.track_tensors = track_tensors
        self.origin = time.perf_counter() if origin is None else origin
        self.result: ProbeResult | None = None
        self._samples: list[Sample] = []
        self._sampling = False
        self._tracker: LiveTensorTracker | None = None
        self._dev = None
        self._dev_sampled_peak = 0

    def _take(self, t: float, mem: tuple[int, int] | None) -> None:
        # one pread of /proc/self/statm per sample: the thread's cost stays small at 500 samples/s
        if mem is not None:
            self._samples.append(Sample(t - self.origin, *mem))
        if self._dev is not None:
            self._dev_sampled_peak = max(self._dev_sampled_peak, _allocated(self._dev, self._dev_device))

    def __enter__(self) -> MemoryProbe:
        if self.trim_heap:
            malloc_trim()
        self._start_mem = start = read_probe_memory()
        self._dev = _device_module(self.device)
        if self._dev is not None:
            self._dev_device = _device_index(self._dev, self.device)
            self._dev.synchronize()
            self._dev_start = _allocated(self._dev, self._dev_device)
            self._dev_max_start = _max_allocated(self._dev, self._dev_device)
            self._dev_sampled_peak = self._dev_start
        self._take(time.perf_counter(), (start.rss, start.anon) if start is not None else None)  # the first sample
        _SAMPLER.add(self)
        self._sampling = True
        if self.track_tensors:
            self._tracker = LiveTensorTracker()
            self._tracker.__enter__()
        self._t0 = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        wall = time.perf_counter() - self._t0
        if self._tracker is not None:
            self._tracker.__exit__(*exc)
        if self._sampling:
            _SAMPLER.remove(self)
            self._sampling = False
        end = read_probe_memory()
        self._take(time.perf_counter(), (end.rss, end.anon) if end is not None else None)  # the last sample
        start = self._start_mem
        samples = self._in_region(wall)
        rss_peak = anon_peak = None
        if samples:
            rss_peak = max(s.rss for s in samples)
            anon_peak = max(s.anon for s in samples)
            if end is not None and start is not None and end.hwm > start.hwm:  # a new VmHWM was set inside
                rss_peak = max(rss_peak, end.hwm)
        dev_peak = dev_delta = None
        if self._dev is not None:
            self._dev.synchronize()
            dev_end = _allocated(self._dev, self._dev_device)
            dev_peak = max(self._dev_sampled_peak, dev_end)
            dev_max = _max_allocated(self._dev, self._dev_device)
            if dev_max > self._dev_max_start:  # a new high-water mark was set inside the region
                dev_peak = max(dev_peak, dev_max)
            dev_delta = dev_end - self._dev_start
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
            timeline=samples[:-1][:: max(1, len(samples) // 200)] + samples[-1:],
            start_s=self._t0 - self.origin,
            segments=[(self._t0 - self.origin, wall)],
        )

    def _in_region(self, wall: float) -> list[Sample]:
        """The samples of the region ``[t0, t0 + wall]``: the first one (taken just before ``t0``) and the last
        one (just after the end) are stamped at the region's bounds, which they measure; the thread's samples
        taken while the probe was starting or stopping are dropped, so a plot never draws a stage's line
        outside its time span."""
        if not self._samples:
            return []
        t0 = self._t0 - self.origin
        t1 = t0 + wall
        first, *middle = self._samples
        out = [Sample(t0, first.rss, first.anon)] + [s for s in middle[:-1] if t0 <= s.t <= t1]
        if middle:
            last = middle[-1]
            out.append(Sample(t1, last.rss, last.anon))
        return out
