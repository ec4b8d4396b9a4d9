"""Resuming on another world size (issue 12): a SHARDED (DCP) checkpoint written by 2 ranks loads on 4 and
one written by 4 loads on 2; a FULL one loads anywhere. After ``load_state`` the full parameters and the full
optimizer state are bitwise those that were saved, the ranks that have a ``random_states_<rank>.pkl`` get
their random state back, the others keep theirs with a warning (stock accelerate keeps it too), and one
more step trains. A checkpoint holding per-rank files (FSDP ``LOCAL_STATE_DICT``) is refused, naming the file.
"""

from __future__ import annotations

import shutil

import pytest
import torch

from accelerate_memsafe.errors import CheckpointError
from accelerate_memsafe.io import atomic
from tests.distributed import workers_reshard
from tests.spawn import run_on_ranks

CASES = [  # (saved by, loaded by, state-dict type, optimizer_offload on load); the default suite runs the first
    (2, 4, "SHARDED_STATE_DICT", True),
    pytest.param(4, 2, "SHARDED_STATE_DICT", False, marks=pytest.mark.slow),
    pytest.param(2, 4, "FULL_STATE_DICT", False, marks=pytest.mark.slow),
]


def _assert_equal_states(got: dict, want: dict, what: str) -> None:
    assert got.keys() == want.keys(), f"{what}: keys differ"
    for key, value in want.items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(got[key], value), f"{what}: `{key}` differs"
        elif isinstance(value, dict):
            _assert_equal_states(got[key], value, f"{what}.{key}")
        elif isinstance(value, list):
            assert len(got[key]) == len(value), f"{what}.{key}"
            for i, (a, b) in enumerate(zip(got[key], value)):
                _assert_equal_states(a, b, f"{what}.{key}[{i}]") if isinstance(b, dict) else None
                assert isinstance(b, dict) or a == b, f"{what}.{key}[{i}]: {a} != {b}"
        else:
            assert got[key] == value, f"{what}: `{key}` {got[key]} != {value}"


@pytest.mark.parametrize(("saved_by", "loaded_by", "sdt", "offload"), CASES,
                         ids=["2to4-sharded", "4to2-sharded", "2to4-full"])
def test_checkpoint_loads_on_another_world_size(tmp_path, saved_by, loaded_by, sdt, offload):
    out = str(tmp_path / "ckpt")
    saved = run_on_ranks(workers_reshard.save, saved_by, init_process_group=False, timeout=400, out=out, sdt=sdt,
                         offload=False)
    loaded = run_on_ranks(workers_reshard.load, loaded_by, init_process_group=False, timeout=400, out=out, sdt=sdt,
                          offload=offload)
    _assert_equal_states(loaded[0]["model"], saved[0]["model"], "model")
    _assert_equal_states(loaded[0]["optimizer"], saved[0]["optimizer"], "optimizer")
    for rank, result in enumerate(loaded):
        if rank < saved_by:
            assert torch.equal(result["rng"], saved[rank]["rng"]), f"rank {rank}: random state not restored"
        else:
            assert torch.equal(result["rng"], result["rng_before"]), f"rank {rank}: random state changed"
            assert any(f"random_states_{rank}.pkl" in w for w in result["warnings"]), result["warnings"]
        assert any(f"written by {saved_by} process(es) and is loaded by {loaded_by}" in w for w in result["warnings"])


@pytest.mark.slow
def test_stock_accelerate_loads_the_same_resharded_state(tmp_path):
    out = str(tmp_path / "ckpt")
    run_on_ranks(workers_reshard.save, 2, init_process_group=False, timeout=400, out=out, sdt="SHARDED_STATE_DICT",
                 offload=False)
    ours = run_on_ranks(workers_reshard.load, 4, init_process_group=False, timeout=400, out=out,
                        sdt="SHARDED_STATE_DICT", offload=False)
    stock = run_on_ranks(workers_reshard.load, 4, init_process_group=False, timeout=400, out=out,
                         sdt="SHARDED_STATE_DICT", offload=False, stock=True)
    _assert_equal_states(ours[0]["model"], stock[0]["model"], "model")
    _assert_equal_states(ours[0]["optimizer"], stock[0]["optimizer"], "optimizer")


def test_per_rank_files_are_refused_on_another_world_size_naming_the_file(tmp_path):
    d = tmp_path / "ckpt"
    d.mkdir()
    for rank in range(2):
        torch.save({}, d / f"random_states_{rank}.pkl")
        torch.save({"flat": torch.zeros(3)}, d / f"pytorch_model_fsdp_rank{rank}.bin")
    atomic.check_loadable(d, world_size=2)  # the world size that wrote it
    with pytest.raises(CheckpointError, match=r"pytorch_model_fsdp_rank0\.bin cannot be resharded: .*LOCAL_STATE_DICT"):
        atomic.check_loadable(d, world_size=4)
    shutil.rmtree(d / "pytorch_model_fsdp_rank0.bin", ignore_errors=True)
    for rank in range(2):
        (d / f"pytorch_model_fsdp_rank{rank}.bin").unlink()
    atomic.check_loadable(d, world_size=4)  # nothing per-rank left: loads (resharded)
