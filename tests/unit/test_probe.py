"""The probe and the live tensor tracker measure what they claim."""

from __future__ import annotations

import pytest
import torch

from accelerate_memsafe.memory.probe import MemoryProbe
from accelerate_memsafe.memory.procfs import malloc_trim, read_proc_memory
from accelerate_memsafe.memory.tracker import LiveTensorTracker


def test_tracker_counts_live_bytes_and_peak():
    with LiveTensorTracker() as t:
        a = torch.empty(1024, dtype=torch.float32)  # 4 KiB
        b = torch.empty(2048, dtype=torch.float32)  # 8 KiB
        assert t.live_bytes == 12 * 1024
        del a
        assert t.live_bytes == 8 * 1024
        v = b.view(2, 1024)  # a view is not an allocation
        assert t.live_bytes == 8 * 1024
        del b
        assert t.live_bytes == 8 * 1024, "the view keeps the storage alive"
        del v
    assert t.live_bytes == 0
    assert t.peak_bytes == 12 * 1024


def test_tracker_ignores_preexisting_tensors_and_reports_allocations():
    x = torch.ones(4096)
    seen = []
    with LiveTensorTracker(on_alloc=lambda op, t: seen.append((op, t.numel()))) as t:
        x.add_(1)  # in place on a tensor from before: no allocation
        y = x * 2
    assert t.peak_bytes == y.numel() * 4
    assert seen and seen[0][1] == 4096 and "mul" in seen[0][0]


def test_probe_reports_rss_and_anon():
    assert read_proc_memory() is not None
    # freed heap that glibc kept resident (earlier tests) would hold the new tensor without growing RssAnon
    malloc_trim()
    with MemoryProbe() as probe:
        x = torch.ones(32 * 2**20 // 4)
    r = probe.result
    assert r.cpu_anon_peak_bytes - r.cpu_anon_start_bytes >= 30 * 2**20
    assert r.live_tensor_peak_bytes >= 32 * 2**20
    assert r.device_peak_bytes is None and r.device_delta_bytes is None
    del x


def test_the_probe_leaves_glibcs_heap_alone_unless_asked(monkeypatch):
    """A trim before every stage handed the heap a training step freed back to the kernel, to be faulted in again
    by the next allocations (a second `prepare` in one process took twice stock's wall): only on request."""
    import accelerate_memsafe.memory.probe as probe_mod

    trims = []
    monkeypatch.setattr(probe_mod, "malloc_trim", lambda: trims.append(1))
    with MemoryProbe(track_tensors=False):
        pass
    assert trims == []
    with MemoryProbe(track_tensors=False, trim_heap=True):
        pass
    assert trims == [1]


class _FakeCuda:
    """Stands in for ``torch.cuda``'s allocator statistics: ``allocated`` is the live figure, ``peak`` the
    allocator's high-water mark (raised with ``allocated``, lowered only by ``reset_peak_memory_stats``)."""

    def __init__(self, allocated: int, peak: int):
        self.allocated, self.peak, self.resets, self.reads = allocated, peak, 0, 0

    def set(self, allocated: int) -> None:
        self.allocated = allocated
        self.peak = max(self.peak, allocated)

    def memory_allocated(self, device=None) -> int:
        self.reads += 1
        return self.allocated

    def max_memory_allocated(self, device=None) -> int:
        return self.peak

    def reset_peak_memory_stats(self, device=None) -> None:
        self.resets += 1
        self.peak = self.allocated

    def wait_for_samples(self, n: int = 3) -> None:
        import time

        start, deadline = self.reads, time.monotonic() + 10
        while self.reads < start + n and time.monotonic() < deadline:
            time.sleep(0.001)


def _fake_cuda(monkeypatch, allocated: int, peak: int) -> _FakeCuda:
    fake = _FakeCuda(allocated, peak)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    for name in ("memory_allocated", "max_memory_allocated", "reset_peak_memory_stats"):
        monkeypatch.setattr(torch.cuda, name, getattr(fake, name))
    return fake


def test_probe_never_resets_the_users_device_peak(monkeypatch):
    # The user's run already peaked at 1000 bytes; the probed region goes 100 -> 500 -> 200.
    fake = _fake_cuda(monkeypatch, allocated=100, peak=1000)
    with MemoryProbe(torch.device("cuda"), track_tensors=False) as probe:
        fake.set(500)
        fake.wait_for_samples()
        fake.set(200)
    assert fake.resets == 0, "the probe must not call `torch.cuda.reset_peak_memory_stats()`"
    assert torch.cuda.max_memory_allocated() == 1000, "the user's peak was lowered"
    assert probe.result.device_peak_bytes == 500, "the region's own peak, not the user's earlier one"
    assert probe.result.device_delta_bytes == 100


def test_probe_reports_a_new_device_high_water_mark_exactly(monkeypatch):
    # A transient peak too short for the sampler: it raised the allocator's high-water mark, which is exact.
    fake = _fake_cuda(monkeypatch, allocated=100, peak=1000)
    with MemoryProbe(torch.device("cuda", 0), track_tensors=False) as probe:
        fake.set(1500)
        fake.allocated = 300  # freed before any sample could see it
    assert fake.resets == 0
    assert probe.result.device_peak_bytes == 1500
    assert probe.result.device_delta_bytes == 200


def test_probe_never_lowers_the_processes_vmhwm():
    """``VmHWM`` is what ``/usr/bin/time``-style tools and the user's own logging read: a probe around a
    small region after a large transient must leave it at the large transient's level."""
    import ctypes

    big = torch.ones(256 * 2**20 // 4)  # 256 MiB touched, then freed (mmap'ed: returned to the kernel)
    del big
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    hwm_before = read_proc_memory().hwm
    with MemoryProbe() as probe:
        small = torch.ones(2**20)
    del small
    assert read_proc_memory().hwm >= hwm_before, "the probe reset VmHWM"
    assert probe.result.cpu_rss_peak_bytes < hwm_before  # the region's own peak, not the earlier transient


def test_probe_takes_a_new_vmhwm_set_inside_the_region():
    hwm_before = read_proc_memory().hwm
    with MemoryProbe() as probe:
        x = torch.ones((hwm_before - read_proc_memory().rss + 64 * 2**20) // 4)  # rises above the old VmHWM
        del x
    assert probe.result.cpu_rss_peak_bytes >= hwm_before + 32 * 2**20


def test_building_the_accelerator_takes_the_processs_first_memory_reading_off_the_hooks_path():
    # the first reading opens /proc/self/statm (kept open for the process's later reads): half a millisecond that the
    # first probe of a hook paid; start_sampler (run when a memsafe accelerator is built) takes it
    import os

    from accelerate_memsafe.memory import procfs
    from accelerate_memsafe.memory.probe import start_sampler

    if not os.path.exists("/proc/self/statm"):
        pytest.skip("no /proc/self/statm here")
    procfs._STATM.clear()
    start_sampler()
    assert str(os.getpid()) in procfs._STATM


def test_the_sampling_thread_is_woken_once_for_a_run_of_short_probes_and_idles_after():
    """A hook's short stages probed one after the other wake the sampling thread once (each wake is a hand-off of the
    GIL), not once per probe; once every probe closed it goes idle (a training loop between hooks is never woken)."""
    import time

    from accelerate_memsafe.memory import probe as probe_mod

    sampler = probe_mod._SAMPLER
    with MemoryProbe(interval_s=0.01):  # the thread is started and active
        pass
    deadline = time.monotonic() + 5
    while sampler._active and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not sampler._active, "the thread must go idle once no probe is open"
    before = sampler.wakes
    for _ in range(20):
        with MemoryProbe(track_tensors=False, interval_s=0.05):
            pass
    # once, unless the machine held this thread past an interval between two of them (then twice or so); never 20
    woken = sampler.wakes - before
    assert woken <= 3, f"twenty probes within one interval woke the thread {woken} times"
    time.sleep(0.2)
    assert not sampler._active and sampler.wakes - before == woken


def test_a_probe_longer_than_its_interval_is_sampled_by_the_thread():
    """The thread's first sample comes one interval after the run of probes began, then one every interval: a peak
    that came and went inside a probe is in its figures though its start and end readings miss it."""
    import time

    malloc_trim()
    size = 64 << 20
    with MemoryProbe(track_tensors=False, interval_s=0.005) as probe:
        time.sleep(0.02)
        held = torch.ones(size // 4)
        time.sleep(0.05)
        del held
        malloc_trim()
        time.sleep(0.03)
    r = probe.result
    assert len(r.timeline) > 5, r.timeline
    assert r.cpu_anon_peak_bytes - r.cpu_anon_start_bytes >= size * 0.9, (r.cpu_anon_peak_bytes, r.cpu_anon_start_bytes)
    assert r.cpu_anon_delta_bytes < size // 2, "the tensor was freed before the end: the peak came from a thread sample"
