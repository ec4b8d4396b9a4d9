"""``unmodified_file_pages``: which tensors in a private (copy-on-write) file mapping still hold the file's
bytes, read from ``/proc/self/pagemap``; and ``checkpoint_source_names`` re-reading only those."""

from __future__ import annotations

import mmap
import os
import sys

import pytest
import torch

from accelerate_memsafe.io import mapped_pages
from accelerate_memsafe.io.mapped_pages import unmodified_file_pages

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="pagemap is Linux only")

PAGE = mmap.PAGESIZE


@pytest.fixture(autouse=True, params=["pagemap_scan", "pagemap_file"])
def reader(request, monkeypatch):
    """Every test runs on both ways of reading the page records: the kernel's ``PAGEMAP_SCAN`` list of written
    pages (where it works) and the pagemap file's entry per page (older kernels)."""
    if request.param == "pagemap_file":
        monkeypatch.setattr(mapped_pages, "_scan_reports_private_writes", lambda: False)
    elif not mapped_pages._scan_reports_private_writes():
        pytest.skip("this kernel has no working PAGEMAP_SCAN")
    return request.param


def _span(t: torch.Tensor) -> tuple[int, int]:
    return t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()


@pytest.fixture
def mapped(tmp_path):
    """A 64-page file mapped MAP_PRIVATE read-write (as safetensors/transformers map a checkpoint), viewed
    as float32; the mapping is closed after the test."""
    path = tmp_path / "weights.bin"
    path.write_bytes(torch.arange(64 * PAGE // 4, dtype=torch.float32).numpy().tobytes())
    with open(path, "rb") as f:
        mm = mmap.mmap(f.fileno(), 0, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    flat = torch.frombuffer(mm, dtype=torch.float32)
    yield flat
    del flat
    mm.close()


def test_clean_mapping_qualifies_untouched_and_after_reads(mapped):
    per_page = PAGE // 4
    a, b = mapped[: 8 * per_page], mapped[8 * per_page : 40 * per_page]
    assert unmodified_file_pages([_span(a), _span(b)]) == [True, True], "never touched: not present"
    assert float(a.sum()) > 0 and float(b.sum()) > 0  # faults the pages in, read-only
    assert unmodified_file_pages([_span(a), _span(b)]) == [True, True], "present clean file pages"


def test_a_write_disqualifies_the_tensor_and_its_page_neighbours(mapped):
    per_page = PAGE // 4
    big = mapped[4 * per_page : 36 * per_page]  # 32 pages
    left = mapped[1 * per_page + 7 : 4 * per_page + 5]  # not page-aligned; shares big's first page
    far = mapped[40 * per_page : 48 * per_page]
    _ = float(mapped.sum())
    big[16 * per_page + 3] = -1.0  # one element in the middle of a large tensor
    assert unmodified_file_pages([_span(big), _span(left), _span(far)]) == [False, True, True]
    big[1] = -2.0  # on the page big shares with left's last partial page
    assert unmodified_file_pages([_span(big), _span(left), _span(far)]) == [False, False, True]


def test_a_write_is_seen_on_pages_never_read_before(mapped):
    mapped[10 * (PAGE // 4)] = 5.0  # first access is the write: the page is copied, never a file page
    assert unmodified_file_pages([_span(mapped)]) == [False]


def test_anonymous_memory_never_qualifies():
    touched = torch.ones(16 * PAGE // 4)
    untouched = torch.empty(1 << 24, dtype=torch.uint8)  # a fresh anonymous mmap: pages not present
    assert unmodified_file_pages([_span(touched), _span(untouched)]) == [False, False]
    assert unmodified_file_pages([]) == []


def test_unreadable_pagemap_means_nothing_qualifies(mapped, monkeypatch):
    monkeypatch.setattr(mapped_pages, "_PAGEMAP", "/nonexistent/pagemap")
    mapped_pages._pagemap_reports_private_writes.cache_clear()
    try:
        assert unmodified_file_pages([_span(mapped)]) == [False]
    finally:
        monkeypatch.undo()
        mapped_pages._pagemap_reports_private_writes.cache_clear()
    assert unmodified_file_pages([_span(mapped)]) == [True]


def test_a_pagemap_that_shows_no_writes_is_not_trusted(mapped, monkeypatch):
    # a sandbox kernel answering all-zero entries would make every written page look "not present"
    monkeypatch.setattr(mapped_pages, "_pagemap_entries", lambda first, last: torch.zeros(last - first, dtype=torch.int64))
    mapped_pages._pagemap_reports_private_writes.cache_clear()
    try:
        mapped[0] = 1.0
        assert unmodified_file_pages([_span(mapped)]) == [False]
    finally:
        monkeypatch.undo()
        mapped_pages._pagemap_reports_private_writes.cache_clear()


def test_checkpoint_source_names_skips_tensors_written_in_place(tiny_llama_dir):
    from transformers import AutoModelForCausalLM

    from accelerate_memsafe.distributed.meta import checkpoint_source_names

    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32)
    originals = {n: p.detach() for n, p in model.named_parameters()}
    source, names = checkpoint_source_names(originals, os.fspath(tiny_llama_dir))
    assert names == set(originals), "an untouched zero-copy load is read from the file"
    source.close()
    edited = "model.layers.1.mlp.down_proj.weight"
    with torch.no_grad():
        w = model.get_parameter(edited)
        w.view(-1)[w.numel() // 2] += 1.0  # same address, one element changed
    source, names = checkpoint_source_names(originals, os.fspath(tiny_llama_dir))
    assert edited not in names, "an in-place edit on rank 0 must be read from memory, not the file"
    assert len(names) >= len(originals) - 3, "only the edited tensor and its page neighbours are dropped"
    source.close()


def test_the_scan_holds_one_window_of_entries_at_a_time(mapped, monkeypatch, reader):
    """The pagemap of a large mapping is read and reduced a window at a time (bounded memory, not 33 bytes per
    page of the whole checkpoint), with the same verdicts: a write counted across window edges."""
    if reader != "pagemap_file":
        pytest.skip("the pagemap file's reader only (the kernel's scan copies out only the written ranges)")
    per_page = PAGE // 4
    big = mapped[4 * per_page : 36 * per_page]
    left = mapped[1 * per_page + 7 : 4 * per_page + 5]
    far = mapped[40 * per_page : 48 * per_page]
    _ = float(mapped.sum())
    big[16 * per_page + 3] = -1.0
    spans = [_span(big), _span(left), _span(far), _span(mapped[:64 * per_page])]
    whole = unmodified_file_pages(spans)
    assert whole == [False, True, True, False]
    reads = []
    real = mapped_pages._pagemap_entries
    monkeypatch.setattr(mapped_pages, "SCAN_WINDOW_PAGES", 3)
    monkeypatch.setattr(mapped_pages, "_pagemap_entries", lambda a, b: reads.append(b - a) or real(a, b))
    assert unmodified_file_pages(spans) == whole
    assert reads and max(reads) <= 3 and sum(reads) >= 64


def test_the_kernels_scan_and_the_pagemap_file_find_the_same_written_pages(mapped, reader):
    if reader != "pagemap_scan":
        pytest.skip("compares the two readers")
    per_page = PAGE // 4
    g = torch.Generator().manual_seed(3)
    _ = float(mapped[: 20 * per_page].sum())  # some pages read (the file's), the rest never touched
    written = sorted(set(torch.randint(0, 64, (12,), generator=g).tolist()))
    for p in written:
        mapped[p * per_page + 5] = -1.0
    base = mapped.data_ptr() // PAGE
    ranges = mapped_pages._scan_written(base, base + 64)
    pages = sorted(p - base for a, b in ranges for p in range(a, b))
    assert pages == written
    counts = mapped_pages._written_before(base, base + 64, set(range(base, base + 65)))
    assert [counts[base + k + 1] - counts[base + k] for k in range(64)] == [int(k in written) for k in range(64)]


def test_the_pagemap_is_opened_once_per_process_and_when_the_accelerator_is_built():
    # the in-place claim's PAGEMAP_SCAN queries reuse one open /proc/self/pagemap (as /proc/self/maps): no open per
    # query on prepare's path; check_kernel_support (run when a memsafe accelerator is built) opens it
    import os

    from accelerate_memsafe.io import mapped_pages

    if not os.path.exists("/proc/self/pagemap"):
        pytest.skip("no /proc/self/pagemap here")
    mapped_pages._PAGEMAP_FD.clear()
    mapped_pages.check_kernel_support()
    fd = mapped_pages._PAGEMAP_FD.get(os.getpid())
    assert fd is not None and mapped_pages._pagemap_fd() == fd
