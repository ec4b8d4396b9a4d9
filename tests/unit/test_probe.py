"""The probe and the live tensor tracker measure what they claim."""

from __future__ import annotations

import torch

from accelerate_memsafe.memory.probe import MemoryProbe
from accelerate_memsafe.memory.procfs import read_proc_memory
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
    with MemoryProbe() as probe:
        x = torch.ones(32 * 2**20 // 4)
    r = probe.result
    assert r.cpu_anon_peak_bytes - r.cpu_anon_start_bytes >= 30 * 2**20
    assert r.live_tensor_peak_bytes >= 32 * 2**20
    assert r.device_peak_bytes is None and r.device_delta_bytes is None
    del x
