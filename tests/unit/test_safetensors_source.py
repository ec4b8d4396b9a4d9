"""Lazy safetensors reads: single file, sharded index, row ranges, validation errors."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from accelerate_memsafe import CheckpointError
from accelerate_memsafe.io.mapped_pages import file_mappings
from accelerate_memsafe.io.safetensors_source import SafetensorsSource, is_view_of_entry


@pytest.fixture
def tensors():
    g = torch.Generator().manual_seed(0)
    return {
        "a": torch.randn(7, 3, generator=g),
        "b": torch.randn(5, generator=g).to(torch.bfloat16),
        "c": torch.arange(6, dtype=torch.int64).view(2, 3),
    }


def test_reads_rows_and_whole_tensors(tmp_path, tensors):
    save_file(tensors, tmp_path / "model.safetensors")
    src = SafetensorsSource(tmp_path)
    assert set(src.keys()) == set(tensors)
    for name, t in tensors.items():
        assert torch.equal(src.read(name), t)
    assert torch.equal(src.read("a", 2, 5), tensors["a"][2:5])
    out = torch.empty(3, 3)
    assert src.read("a", 4, 7, out=out) is out and torch.equal(out, tensors["a"][4:])
    src.close()


def test_sharded_index(tmp_path, tensors):
    save_file({"a": tensors["a"]}, tmp_path / "model-00001-of-00002.safetensors")
    save_file({"b": tensors["b"], "c": tensors["c"]}, tmp_path / "model-00002-of-00002.safetensors")
    index = {"metadata": {}, "weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors", "c": "model-00002-of-00002.safetensors"}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    src = SafetensorsSource(tmp_path)
    assert torch.equal(src.read("c", 1, 2), tensors["c"][1:2])
    index["weight_map"]["d"] = "missing.safetensors"
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="missing.safetensors"):
        SafetensorsSource(tmp_path)


def test_validation_names_missing_and_mismatched_tensors(tmp_path, tensors):
    save_file(tensors, tmp_path / "model.safetensors")
    src = SafetensorsSource(tmp_path / "model.safetensors")
    src.validate({"a": ((7, 3), torch.float32), "c": ((2, 3), None)})
    with pytest.raises(CheckpointError, match=r"missing from the checkpoint: \['zz'\].*`a`: checkpoint \(7, 3\)"):
        src.validate({"zz": ((1,), None), "a": ((3, 7), torch.float32)})
    with pytest.raises(CheckpointError, match="not in the checkpoint"):
        src.read("zz")


def test_truncated_file_is_a_clear_error(tmp_path, tensors):
    save_file(tensors, tmp_path / "model.safetensors")
    data = (tmp_path / "model.safetensors").read_bytes()
    (tmp_path / "model.safetensors").write_bytes(data[:-10])
    with pytest.raises(CheckpointError, match="truncated or corrupt"):
        SafetensorsSource(tmp_path)
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="no safetensors checkpoint"):
        SafetensorsSource(tmp_path / "empty")


def test_detects_zero_copy_views_of_the_file(tiny_llama_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32)
    src = SafetensorsSource(tiny_llama_dir)
    maps = file_mappings(".safetensors")
    w = model.model.embed_tokens.weight
    assert is_view_of_entry(w.detach(), src.entries["model.embed_tokens.weight"], maps)
    assert not is_view_of_entry(w.detach().clone(), src.entries["model.embed_tokens.weight"], maps)
    assert not is_view_of_entry(w.detach(), src.entries["lm_head.weight"], maps), "another tensor's bytes"


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("span", [slice(3, 11), slice(0, 16), slice(15, 16)])
def test_a_dim1_range_is_read_as_the_bytes_of_each_row(tmp_path, out_dtype, span):
    # a fused-expert shape (experts, out, in): a range of dim 1 is contiguous within each row of the file
    w = torch.randn(5, 16, 6).to(torch.bfloat16)
    save_file({"experts": w, "cols": w[:, :, 0].contiguous()}, str(tmp_path / "model.safetensors"))
    src = SafetensorsSource(tmp_path)
    out = torch.empty((3, span.stop - span.start, 6), dtype=out_dtype)
    read = src.read_block("experts", (1, 4), (span, slice(None)), out, chunk_bytes=1 << 20)
    assert torch.equal(out, w[1:4, span].to(out_dtype)) and read == 3 * (span.stop - span.start) * 6 * 2
    two_d = torch.empty((5, span.stop - span.start), dtype=out_dtype)  # a TP column block of a 2-D weight
    src.read_block("cols", (0, 5), (span,), two_d, chunk_bytes=1 << 20)
    assert torch.equal(two_d, w[:, span, 0].to(out_dtype))
    strided = torch.empty((3, 6, span.stop - span.start), dtype=out_dtype).transpose(1, 2)  # not contiguous
    src.read_block("experts", (1, 4), (span, slice(None)), strided, chunk_bytes=1 << 20)
    assert torch.equal(strided, w[1:4, span].to(out_dtype))
    src.close()


def test_the_checkpoint_directory_is_found_from_the_mapping_of_a_zero_copy_load(tmp_path):
    # transformers' own from_pretrained maps the files: rank 0's source finds the checkpoint from its weights,
    # so every_rank also serves models not loaded through accelerate_memsafe.from_pretrained
    from safetensors.torch import load_file, save_file
    from accelerate_memsafe.io.safetensors_source import mapped_checkpoint_dir

    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        save_file({"w": torch.arange(4096.0)}, str(tmp_path / name / "model.safetensors"))
    import mmap

    views = {}
    for name in ("a", "b"):
        with open(tmp_path / name / "model.safetensors", "rb") as fh:  # the mapping outlives the descriptor
            views[name] = torch.frombuffer(mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_COPY), dtype=torch.uint8)
    maps = file_mappings(".safetensors")
    assert mapped_checkpoint_dir([views["a"]], maps) == str((tmp_path / "a").resolve())
    assert mapped_checkpoint_dir([views["a"], torch.ones(8)], maps) == str((tmp_path / "a").resolve())
    assert mapped_checkpoint_dir([views["a"], views["b"]], maps) is None, "two directories: no single checkpoint"
    assert mapped_checkpoint_dir([views["a"].clone()], maps) is None, "a copy maps no file"
    # without `maps`: only the mappings at the tensors' addresses are looked up, with the same answers
    assert mapped_checkpoint_dir([views["a"], torch.ones(8)]) == str((tmp_path / "a").resolve())
    assert mapped_checkpoint_dir([views["a"], views["b"]]) is None
    assert mapped_checkpoint_dir([views["b"].clone(), torch.empty(0)]) is None
    assert torch.equal(load_file(str(tmp_path / "a" / "model.safetensors"))["w"], torch.arange(4096.0))


def test_cast_reads_reuse_one_buffer_per_thread(tmp_path, monkeypatch):
    # rows read only to be cast (a bf16 file into fp32 shards) go through one reused scratch buffer: a series of
    # chunks of varying sizes allocated and freed one by one fragmented glibc's heap (a 1g Llama on 2 ranks kept
    # ~390 MiB of freed chunks resident in rank0_distribute)
    g = torch.Generator().manual_seed(0)
    tensors = {f"w{i}": torch.randn(40 + 7 * i, 16 + 8 * i, generator=g).to(torch.bfloat16) for i in range(5)}
    save_file(tensors, tmp_path / "model.safetensors")
    src = SafetensorsSource(tmp_path)
    seen = []
    real = SafetensorsSource.read

    def read(self, name, start=None, stop=None, *, out=None):
        seen.append(None if out is None else out.untyped_storage().data_ptr())
        return real(self, name, start, stop, out=out)

    monkeypatch.setattr(SafetensorsSource, "read", read)
    for name, t in tensors.items():
        out = torch.empty(t.shape, dtype=torch.float32)
        src.read_block(name, (0, t.shape[0]), None, out, chunk_bytes=1000)
        assert torch.equal(out, t.float())
    assert None not in seen and len(seen) > 2 * len(tensors)
    # the buffer only grows (to the largest chunk), so few distinct allocations however many chunks
    assert len(set(seen)) <= len(tensors), len(set(seen))
    src.close()


def test_rank0_sends_checkpoint_rows_from_a_mapping_and_drops_its_pages_once_sent(tmp_path):
    """``load_source="rank0"`` from a lazily read checkpoint: rows whose dtype is the file's are handed to the
    transport as views of a mapping of the file (the kernel copies the page cache once, into the socket, not
    into a ``pread`` buffer first): the same bytes as a read; a cast is not a view. Once sent, the pages they
    faulted in leave the process's RSS (``Rank0Source.sent``), views of the model's own tensors are left alone."""
    from accelerate_memsafe.distributed.source import Rank0Source
    from accelerate_memsafe.memory.procfs import read_proc_memory

    w = torch.randn(512, 1024)  # 2 MiB: whole pages
    save_file({"w": w, "b": torch.arange(10.0)}, str(tmp_path / "model.safetensors"))
    ckpt = SafetensorsSource(tmp_path)
    own = torch.ones(4096)
    src = Rank0Source({"w": torch.empty(512, 1024, device="meta"), "o": own}, ckpt, {"w", "b"})
    view = src.rows_view("w", 128, 512, torch.float32, None)
    assert view is not None and view.dtype == torch.uint8
    assert torch.equal(view.view(torch.float32).view(384, 1024), w[128:512])
    assert src.rows_view("w", 0, 1, torch.bfloat16, None) is None  # a cast is read into a buffer
    assert any(path.endswith("model.safetensors") for *_, path in file_mappings(".safetensors"))
    before = read_proc_memory().rss
    assert int(view.sum()) >= 0  # fault every page in, as the socket write does
    faulted = read_proc_memory().rss - before
    mine = src.rows_view("o", 0, 4096, torch.float32, None)
    src.sent([view, mine])
    assert src.released_bytes >= view.numel() - 2 * 4096  # the whole pages inside the rows
    assert faulted > 0 and read_proc_memory().rss - before < faulted
    assert torch.equal(view.view(torch.float32).view(384, 1024), w[128:512])  # still readable: re-read from the file
    assert torch.equal(own, torch.ones(4096))
    mapping = next(iter(ckpt._maps.values()))[0]
    del view, mine
    src.close()
    assert mapping.closed  # no view left: close() unmaps the file


@pytest.mark.parametrize("ioctl", [True, False], ids=["procmap_query", "maps_file"])
def test_the_mappings_at_some_addresses_are_those_of_the_whole_maps_file_that_hold_them(tmp_path, monkeypatch, ioctl):
    # meta_placement asks the kernel for the few mappings its weights lie in (PROCMAP_QUERY) instead of reading
    # all of /proc/self/maps: the same tuples, for every address asked about, and nothing for anonymous memory
    import mmap

    from accelerate_memsafe.io import mapped_pages

    if not ioctl:  # a kernel without the ioctl: the answer comes from the maps file
        monkeypatch.setattr(mapped_pages, "_query_mapping", lambda fd, addr, name: False)
        monkeypatch.setattr(mapped_pages, "_MAPS_FD", {})
    views = {}
    for name in ("a", "b", "c"):
        (tmp_path / name).mkdir()
        save_file({"w": torch.arange(8192.0)}, str(tmp_path / name / "model.safetensors"))
        with open(tmp_path / name / "model.safetensors", "rb") as fh:
            views[name] = torch.frombuffer(mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_COPY), dtype=torch.uint8)
    everything = mapped_pages.file_mappings(".safetensors")
    asked = [views["a"].data_ptr() + 5000, views["a"].data_ptr(), views["c"].data_ptr() + 100, torch.ones(8).data_ptr()]
    got = mapped_pages.file_mappings_at(asked, ".safetensors")
    holding = [m for m in everything if any(m[0] <= a < m[1] for a in asked)]
    assert got == holding if ioctl else got == everything
    assert {m[3] for m in holding} == {str((tmp_path / n / "model.safetensors").resolve()) for n in ("a", "c")}
    assert mapped_pages.file_mappings_at([torch.ones(8).data_ptr()], ".safetensors") == ([] if ioctl else everything)
    assert mapped_pages.file_mappings_at([views["b"].data_ptr()], ".json") == ([] if ioctl else mapped_pages.file_mappings(".json"))
