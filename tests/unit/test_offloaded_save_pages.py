"""Releasing the resident pages of memory-mapped weights after their shard is written: RSS goes down,
values never change (clean pages are re-read from the file, modified pages are kept)."""

from __future__ import annotations

import torch

from accelerate_memsafe.io.mapped_pages import file_backed_ranges, file_extents, release_mapped_pages
from accelerate_memsafe.memory.procfs import read_proc_memory

MIB = 2**20


def _mapped(tmp_path, n_bytes: int) -> torch.Tensor:
    path = tmp_path / "weights.bin"
    torch.arange(n_bytes // 4, dtype=torch.float32).numpy().tofile(path)
    # MAP_PRIVATE of the file, like transformers' zero-copy views of a checkpoint.
    return torch.from_file(str(path), shared=False, size=n_bytes // 4, dtype=torch.float32)


def test_resident_pages_of_a_mapped_tensor_are_released_and_values_kept(tmp_path):
    t = _mapped(tmp_path, 64 * MIB)
    expected = float(t.double().sum())  # faults every page in
    before = read_proc_memory().rss
    advised = release_mapped_pages([t])
    after = read_proc_memory().rss
    assert advised >= 63 * MIB
    assert before - after >= 48 * MIB
    assert float(t.double().sum()) == expected  # re-read from the file


def test_modified_pages_survive(tmp_path):
    t = _mapped(tmp_path, 8 * MIB)
    t[:1000] = -1.0  # private (copy-on-write) pages
    release_mapped_pages([t])
    assert torch.equal(t[:1000], torch.full((1000,), -1.0))
    assert t[5000].item() == 5000.0


def test_ordinary_allocations_are_never_advised():
    x = torch.ones(4 * MIB)
    assert release_mapped_pages([x]) == 0
    assert release_mapped_pages([x], file_backed_ranges()) == 0
    assert float(x.sum()) == 4 * MIB


def test_file_extents_point_at_the_bytes_a_clean_mapped_tensor_holds(tmp_path):
    t = _mapped(tmp_path, 4 * MIB)
    view = t[1000:3000]  # a contiguous view inside the mapping
    (tmp_path / "w").mkdir()
    written = _mapped(tmp_path / "w", 4 * MIB)
    written[7] = -1.0  # one page becomes a private copy: the file no longer holds the tensor's bytes
    anonymous = torch.ones(1024)
    extents = file_extents([t, view, written, anonymous, t[::2]])
    assert [e is not None for e in extents] == [True, True, False, False, False]
    whole, part = extents[0], extents[1]
    assert (whole.offset, whole.nbytes) == (0, 4 * MIB)
    assert (part.offset, part.nbytes) == (4000, 8000)
    with open(part.path, "rb") as f:
        f.seek(part.offset)
        assert f.read(part.nbytes) == view.numpy().tobytes()
    assert whole.part(4000, 8000) == part
