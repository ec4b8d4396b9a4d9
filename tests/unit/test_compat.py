"""The private-API module checks the accelerate version it was written against."""

from __future__ import annotations

import pytest

from accelerate_memsafe import _compat
from tests import releases


def test_installed_accelerate_is_a_tested_version():
    assert _compat.check_accelerate_version() is True


def test_untested_version_warns():
    with pytest.warns(UserWarning, match="tested with accelerate"):
        assert _compat.check_accelerate_version("9.0.0") is False


def test_fsdp2_prepare_model_reads_only_what_the_view_provides():
    # If accelerate starts reading another accelerator attribute, fsdp2_wrap's view must grow: this test
    # pins the attribute set by inspecting the function's source.
    import inspect
    import io
    import tokenize

    from accelerate.utils import fsdp2_prepare_model

    # the code's tokens only: a comment naming `accelerator.py` (accelerate 1.10) reads no attribute
    src = inspect.getsource(fsdp2_prepare_model)
    toks = [t.string for t in tokenize.generate_tokens(io.StringIO(src).readline)
            if t.type not in (tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT)]
    used = {toks[i + 2] for i in range(len(toks) - 2) if toks[i] == "accelerator" and toks[i + 1] == "."}
    used |= {toks[i + 4].strip("\"'") for i in range(len(toks) - 4)
             if toks[i : i + 4] == ["getattr", "(", "accelerator", ","]}
    assert "state" in used, used  # the walk sees the reads
    assert used <= {"state", "torch_device_mesh", "parallelism_config", "mixed_precision", "is_main_process", "device"}, used


def test_start_next_epoch_fresh_drops_only_a_finished_single_process_state():
    import torch
    from torchdata.stateful_dataloader import StatefulDataLoader

    dl = StatefulDataLoader(torch.arange(6), batch_size=2, shuffle=True)
    it = iter(dl)
    next(it)
    mid = dl.state_dict()
    list(it)
    finished = dl.state_dict()
    assert finished["_iterator_finished"] is True
    dl.load_state_dict(mid)
    assert not _compat.start_next_epoch_fresh(dl) and dl.next_iter_state is not None  # mid-epoch: torchdata's
    dl.load_state_dict(finished)
    assert _compat.start_next_epoch_fresh(dl) and dl.next_iter_state is None
    assert len(list(dl)) == 3  # a whole new epoch, not the replayed one
    assert not _compat.start_next_epoch_fresh(torch.utils.data.DataLoader(torch.arange(4)))


def test_start_next_epoch_fresh_leaves_an_untested_torchdata_alone(monkeypatch):
    import torch
    import torchdata
    from torchdata.stateful_dataloader import StatefulDataLoader

    dl = StatefulDataLoader(torch.arange(4), batch_size=2)
    list(dl)
    dl.load_state_dict(dl.state_dict())
    monkeypatch.setattr(torchdata, "__version__", "9.0.0")
    with pytest.warns(UserWarning, match="torchdata >=0.10.0,<0.12.0; found torchdata 9.0.0"):
        assert not _compat.start_next_epoch_fresh(dl)
    assert dl.next_iter_state is not None


def test_tp_already_applied_replaces_accelerates_prepare_tp_with_its_non_model_passes():
    # accelerate's `_prepare_tp` prepares non-model objects in two passes, then wraps the model's parameters
    # with transformers' ReplicateParallel; the plugin keeps the two passes and drops the model pass
    import inspect

    import torch
    from accelerate import Accelerator

    src = inspect.getsource(Accelerator._prepare_tp)
    assert "first_pass=True" in src and "ReplicateParallel" in src
    assert "_prepare_tp(*args)" in inspect.getsource(Accelerator.prepare)

    calls = []

    class Fake:
        def _prepare_one(self, obj, first_pass=False):
            calls.append((obj, first_pass))
            return f"{obj}'"

    acc, model = Fake(), torch.nn.Linear(2, 2)
    with _compat.tp_already_applied(acc):
        out = acc._prepare_tp(model, "opt")
    assert out[0] is model and out[1] == "opt''" and calls == [("opt", True), ("opt'", False)]
    assert not hasattr(acc, "_prepare_tp"), "the accelerator's own method is back after the block"


def test_local_numel_reads_the_local_shard_and_falls_back_to_the_public_api():
    import torch

    class Sharded:  # what `_compat.local_numel` reads of a DTensor: its `_local_tensor`
        _local_tensor = torch.zeros(3, 4)

        def to_local(self):
            raise AssertionError("the local tensor was there to read")

    class OnlyPublic:  # a DTensor of a torch without `_local_tensor`: `to_local()`, without autograd
        def to_local(self):
            assert not torch.is_grad_enabled()
            return torch.zeros(5)

    assert _compat.local_numel(torch.zeros(2, 3)) == 6
    assert _compat.local_numel(Sharded()) == 12
    assert _compat.local_numel(OnlyPublic()) == 5


def test_dtensor_chunks_compute_plain_blocks_and_leave_the_rest_to_dcps_protocol(monkeypatch):
    import torch
    import torch.distributed.tensor._utils as dtensor_utils

    class Placement:
        def __init__(self, partial=False):
            self.partial = partial

        def is_partial(self):
            return self.partial

    class Fake:  # what the helper reads of a DTensor; the protocol is the fallback
        shape, device_mesh = torch.Size([8, 4]), "mesh"

        def __init__(self, local, placements):
            self._local_tensor, self.placements = local, placements

        def __create_chunk_list__(self):
            from types import SimpleNamespace

            return [SimpleNamespace(offsets=torch.Size([0, 0]), sizes=torch.Size([1, 1]))] * 2

    asked = []

    def compute(shape, mesh, placements):  # the private function: (sizes, offsets)
        asked.append((tuple(shape), mesh, len(placements)))
        return (4, 4), (4, 0)

    monkeypatch.setattr(dtensor_utils, "compute_local_shape_and_global_offset", compute)
    assert _compat.dtensor_chunks(Fake(torch.zeros(4, 4), [Placement()])) == [((4, 0), (4, 4))]
    assert asked == [((8, 4), "mesh", 1)]
    # a partial placement (the protocol refuses it with its own error) or a local tensor subclass: the protocol
    protocol = [((0, 0), (1, 1))] * 2
    assert _compat.dtensor_chunks(Fake(torch.zeros(4, 4), [Placement(partial=True)])) == protocol
    subclass = torch.zeros(4, 4).as_subclass(type("Sub", (torch.Tensor,), {}))
    assert _compat.dtensor_chunks(Fake(subclass, [Placement()])) == protocol
    monkeypatch.delattr(dtensor_utils, "compute_local_shape_and_global_offset")  # a torch without it: the protocol
    assert _compat.dtensor_chunks(Fake(torch.zeros(4, 4), [Placement()])) == protocol
    assert len(asked) == 1


def test_context_parallel_refusal_is_accelerates_own_and_attaches_nothing():
    # differential: the refusal is accelerate's (`_prepare_cp` calls `_attach_context_parallel_hooks` first thing),
    # word for word, for a model with sliding-window layers; a full-attention model is accepted; and asking attaches
    # no hook to the model (accelerate's call, which attaches them, runs later inside `prepare`)
    import inspect

    from accelerate import Accelerator
    from accelerate.big_modeling import _attach_context_parallel_hooks
    from transformers import LlamaForCausalLM, MistralForCausalLM

    from accelerate_memsafe.models import llama_config

    assert "_attach_context_parallel_hooks(arg)" in inspect.getsource(Accelerator._prepare_cp)
    cfg = llama_config("tiny")
    full = LlamaForCausalLM(cfg)
    assert _compat.context_parallel_refusal(full) is None
    assert not any(m._forward_pre_hooks for m in full.modules())
    sliding = MistralForCausalLM(cfg.__class__(**{**cfg.to_dict(), "sliding_window": 8}))
    mine = _compat.context_parallel_refusal(sliding)
    assert not any(m._forward_pre_hooks for m in sliding.modules()), "asking attached a hook"
    try:
        _attach_context_parallel_hooks(sliding)
        theirs = None  # accelerate before 1.15 checks no layer type: it attaches its hooks, and refuses nothing
    except ValueError as exc:
        theirs = str(exc)
    assert mine == theirs
    if releases.accelerate_refuses_context_parallel_layer_types():
        assert mine is not None and "MistralForCausalLM" in mine


def test_checkpoint_file_offset_is_where_torch_save_wrote_the_tensors_bytes(tmp_path):
    """`_compat.checkpoint_file_offset` reads torch's private `_checkpoint_offset` of a `meta` load's storages: from
    `TORCH_META_CHECKPOINT_OFFSET` on it is the position of the storage's bytes in the file (the optimizer reload reads
    there); before, torch records none and the function says so (the reload maps the file instead)."""
    import torch

    saved = {"a": torch.arange(7, dtype=torch.float32), "b": torch.arange(12, dtype=torch.int64).view(3, 4)[:, 1:],
             "c": torch.randn(2, 3, 4, 4).to(memory_format=torch.channels_last)}
    path = tmp_path / "state.bin"
    torch.save(saved, path)
    meta = torch.load(path, map_location="meta", weights_only=True)
    raw = path.read_bytes()
    offsets = {k: _compat.checkpoint_file_offset(t) for k, t in meta.items()}
    if _compat.Version(torch.__version__.split("+")[0]) < _compat.TORCH_META_CHECKPOINT_OFFSET:
        assert set(offsets.values()) == {None}, offsets
        return
    for k, t in saved.items():
        storage = t.untyped_storage()
        assert offsets[k] is not None, k
        assert raw[offsets[k]:offsets[k] + storage.nbytes()] == bytes(storage), k


def test_a_store_without_clone_is_refused_naming_the_torch_it_needs():
    """A torch below the package's floor (installed without pip's dependency check) has stores without `clone()`:
    the agreements' waiter says so, instead of taking the missing method for an unreachable store."""
    import torch.distributed as dist

    from accelerate_memsafe.distributed import collectives
    from accelerate_memsafe.errors import ConfigError

    class OldStore:  # torch 2.7's stores: no clone
        def wait(self, keys, timeout):
            raise AssertionError("not reached")

    with pytest.raises(ConfigError, match=r"has no `clone\(\)`.*requires torch>=2\.8\.0"):
        collectives._StoreWaiter(OldStore())
    store = dist.TCPStore("127.0.0.1", 0, 1, True, wait_for_workers=False)
    clone = _compat.store_clone(store)  # torch >= 2.8: a second client of the same store
    store.set("k", b"v")
    assert clone is not store and bytes(clone.get("k")) == b"v"
