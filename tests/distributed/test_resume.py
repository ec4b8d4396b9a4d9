"""Exact resume on 2 gloo ranks with FSDP2 and a StatefulDataLoader: save at step k, resume in a fresh
process group, and the losses (and batches) of steps k+1..k+m are bitwise those of the uninterrupted run,
for FULL and SHARDED state dicts, with and without optimizer offload, shuffled and sequential. Also checks
the optimizer reload's memory bound and its in-place read on FSDP2 (fresh optimizer and one with state)."""

from __future__ import annotations

import pytest
import torch

from tests import releases
from tests.distributed import workers_resume
from tests.spawn import run_on_ranks

TYPES = ("SHARDED_STATE_DICT", "FULL_STATE_DICT")  # switching SHARDED -> FULL keeps a valid config
# shuffle -> offload of the saving run, and per state-dict type: (offload, optimizer has state) of the resume
CASES = {
    True: (False, {"FULL_STATE_DICT": (False, False), "SHARDED_STATE_DICT": (True, True)}),
    False: (True, {"FULL_STATE_DICT": (True, True), "SHARDED_STATE_DICT": (False, False)}),
}


def _check(ref, res, *, sdt, offload, pre_step):
    # where torch records no offsets on meta storages, a full optimizer file is mapped and its tensors are live
    # tensors too (the file's pages): the whole state, every rank's part of it
    mapped = 0
    if sdt == "FULL_STATE_DICT" and not releases.torch_records_meta_offsets():
        mapped = sum(next(r for r in res[k]["records"] if r["stage"] == "optimizer_cpu_reload")["details"]["state_bytes"]
                     for k in range(2))
    for rank in range(2):
        for i, (a, b) in enumerate(zip(ref[rank]["batches"], res[rank]["batches"])):
            assert torch.equal(a, b), f"{sdt} rank {rank}: the batch of step {3 + i + 1} differs after the resume"
        assert torch.equal(ref[rank]["losses"], res[rank]["losses"]), (
            f"{sdt} rank {rank}: losses {ref[rank]['losses'].tolist()} vs resumed {res[rank]['losses'].tolist()}"
        )
        assert not res[rank]["leftovers"], f"rank {rank}: loaded tensors still alive: {res[rank]['leftovers']}"
        if offload:
            assert res[rank]["state_on_cpu"]
        record = next(r for r in res[rank]["records"] if r["stage"] == "optimizer_cpu_reload")
        assert record["status"] == "ran", record
        d = record["details"]
        assert d["formats"] == (["dcp"] if sdt == "SHARDED_STATE_DICT" else ["torch_file"])
        if sdt == "SHARDED_STATE_DICT":  # several DCP reads (largest tensors one at a time), one metadata read
            assert d["dcp_loads"] >= 2 and d["dcp_metadata_reads"] == 1, d
        slack = d["largest_state_tensor_bytes"] + 0.05 * d["state_bytes"]
        if pre_step:  # the existing state is alive throughout: only the slack may be allocated
            assert res[rank]["in_place"], "FSDP2 state must be read into the existing tensors"
            assert d["new_bytes"] == 0 and d["in_place_bytes"] == d["state_bytes"]
            assert record["live"] <= slack + mapped, (record["live"], slack + mapped)
        else:
            assert record["live"] <= d["state_bytes"] + slack + mapped, (record["live"], d["state_bytes"] + slack + mapped)
        loader = next(r for r in res[rank]["records"] if r["stage"] == "dataloader_resume" and r["hook"] == "load_state")
        assert loader["status"] == "ran" and loader["details"]["dataloaders"] == 1


@pytest.mark.parametrize("shuffle", [True, pytest.param(False, marks=pytest.mark.slow)], ids=["shuffle", "sequential"])
def test_exact_resume_fsdp2(tmp_path, shuffle):
    save_offload, resumes = CASES[shuffle]
    outs = {sdt: str(tmp_path / sdt) for sdt in TYPES}
    ref = run_on_ranks(workers_resume.reference_run, 2, init_process_group=False, timeout=300,
                       outs=outs, offload=save_offload, shuffle=shuffle, k=3, m=3)
    assert all(r["state_on_cpu"] for r in ref) or not save_offload
    for sdt, (offload, pre_step) in resumes.items():
        res = run_on_ranks(workers_resume.resumed_run, 2, init_process_group=False, timeout=300, m=3,
                           out=outs[sdt], sdt=sdt, offload=offload, shuffle=shuffle, pre_step=pre_step)
        _check(ref, res, sdt=sdt, offload=offload, pre_step=pre_step)


def test_truncated_sharded_optimizer_file_is_refused_before_anything_changes(tmp_path):
    """A DCP optimizer file cut short, in a checkpoint without our marker (as stock accelerate writes it)."""
    out = tmp_path / "SHARDED_STATE_DICT"
    run_on_ranks(workers_resume.reference_run, 2, init_process_group=False, timeout=300,
                 outs={"SHARDED_STATE_DICT": str(out)}, offload=False, shuffle=False, k=1, m=1)
    (out / ".memsafe_complete.json").unlink()
    victim = out / "optimizer_0" / "__1_0.distcp"
    victim.write_bytes(victim.read_bytes()[:1000])
    res = run_on_ranks(workers_resume.resumed_run, 2, init_process_group=False, timeout=300, m=1, pre_step=True,
                       expect_refusal=True, out=str(out), sdt="SHARDED_STATE_DICT", offload=False, shuffle=False)
    for rank in range(2):
        assert res[rank]["refused"] and str(victim) in res[rank]["refused"] and "truncated" in res[rank]["refused"]
        assert res[rank]["unchanged"], f"rank {rank}: model or optimizer changed before the refusal"


def test_an_optimizer_that_builds_its_state_when_constructed_trains_saves_and_resumes(tmp_path):
    # torch.optim.Adagrad builds its accumulators (step 0) in its constructor, before `prepare`. Stock accelerate keeps
    # those full-size tensors of the unsharded parameters beside the sharded ones the optimizer builds at its first
    # step, and its `save_state` fails (`state_dict` meets state of parameters no group holds); the plugin drops
    # them at `shard` (the optimizer builds the same for the sharded parameters): bitwise stock's training, a
    # checkpoint, and an exact resume
    results = run_on_ranks(workers_resume.adagrad_run, 2, init_process_group=False, timeout=240, out=str(tmp_path))
    for rank, res in enumerate(results):
        stock, plugin, resumed = res["stock"], res["plugin"], res["resumed"]
        assert stock["state_before_prepare"] > 0 and plugin["state_before_prepare"] > 0
        assert plugin["error"] is None and resumed["error"] is None, (rank, plugin["error"], resumed["error"])
        assert plugin["stale_state"] == 0 and resumed["stale_state"] == 0
        assert resumed["losses"] == plugin["losses"][2:], rank
        # control: stock fails in save_state, after training the same steps
        assert stock["error"] is not None and stock["error"].startswith("KeyError"), (rank, stock)
        assert stock["losses"] == plugin["losses"][:2], rank
        assert stock["stale_state"] > 0
