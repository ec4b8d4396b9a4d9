"""distribute_from_rank0 as a plain function on a 1-rank gloo group: exact copy, odd shapes, bad weights."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from accelerate_memsafe import CheckpointError
from accelerate_memsafe.distributed.collectives import Collectives
from accelerate_memsafe.distributed.meta import move_to_meta, weights_metadata
from accelerate_memsafe.distributed.scatter import distribute_from_rank0
from accelerate_memsafe.distributed.source import Rank0Source


@pytest.fixture
def group():
    from tests.spawn import free_port

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _sharded_model(seed: int = 0):
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(5, 7), nn.Linear(7, 3))
    model.register_buffer("steps", torch.tensor([3, 1, 4]))
    ref = {k: v.clone() for k, v in model.state_dict().items()}
    originals = move_to_meta(model, [], weights_metadata(model), keep=True)
    fully_shard(model)
    return model, ref, originals


def test_copies_every_weight_and_persistent_buffer(group):
    model, ref, originals = _sharded_model()
    stats = distribute_from_rank0(
        model, Rank0Source(originals), coll=Collectives("test", timeout_s=30), bucket_bytes=96,
        prefetch_buckets=1, device=torch.device("cpu"),
    )
    assert stats.sharded_tensors == 4 and stats.replicated_tensors == 1 and stats.buckets > 4
    for name, p in model.named_parameters():
        assert torch.equal(p.to_local(), ref[name]), name
    assert torch.equal(model.steps, ref["steps"])


def test_non_finite_weight_is_named_when_checked(group):
    model, _, originals = _sharded_model()
    originals["1.weight"] = originals["1.weight"].clone()
    originals["1.weight"][2, 0] = float("nan")
    with pytest.raises(CheckpointError, match=r"weight `1.weight` \(rows 2..3\) on rank 0 contains NaN"):
        distribute_from_rank0(
            model, Rank0Source(originals), coll=Collectives("test", timeout_s=30), bucket_bytes=96,
            prefetch_buckets=1, device=torch.device("cpu"), check_finite=True,
        )


def test_missing_source_tensor_is_named(group):
    model, _, originals = _sharded_model()
    del originals["0.bias"]
    with pytest.raises(CheckpointError, match=r"missing \['0.bias'\]"):
        distribute_from_rank0(
            model, Rank0Source(originals), coll=Collectives("test", timeout_s=30), bucket_bytes=1 << 20,
            prefetch_buckets=1, device=torch.device("cpu"),
        )


def test_a_row_larger_than_a_bucket_is_sent_in_dim1_ranges(group):
    from torch.distributed.fsdp import fully_shard

    class Experts(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.gate_up = nn.Parameter(torch.randn(3, 40, 6))  # a row is 960 bytes, a bucket 24 here

    torch.manual_seed(1)
    model = Experts()
    ref = model.gate_up.detach().clone()
    originals = move_to_meta(model, [], weights_metadata(model), keep=True)
    fully_shard(model)
    stats = distribute_from_rank0(model, Rank0Source(originals), coll=Collectives("test", timeout_s=30), bucket_bytes=96,
                                  prefetch_buckets=2, device=torch.device("cpu"))
    assert stats.buckets >= 3 * 40 // 4 and torch.equal(model.gate_up.to_local(), ref)


def test_replicated_tensors_travel_in_one_collective_per_bucket(group, monkeypatch):
    # persistent buffers of several dtypes and shapes (0-d, empty, odd sizes): one broadcast for all of them
    # while they fit the bucket budget, each bitwise rank 0's
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(2)
    model = nn.Sequential(nn.Linear(5, 7))
    extra = {"count": torch.tensor(7), "mask": torch.tensor([True, False, True]), "empty": torch.empty(0, 3),
             "bf16": torch.randn(5, dtype=torch.bfloat16), "table": torch.randint(0, 9, (3, 3), dtype=torch.int16)}
    for name, t in extra.items():
        model.register_buffer(name, t)
    ref = {k: v.clone() for k, v in model.state_dict().items()}
    originals = move_to_meta(model, [], weights_metadata(model), keep=True)
    fully_shard(model)
    calls = []
    real = Collectives.broadcast
    monkeypatch.setattr(Collectives, "broadcast", lambda self, t, **kw: (calls.append(kw.get("what")), real(self, t, **kw))[1])
    stats = distribute_from_rank0(model, Rank0Source(originals), coll=Collectives("test", timeout_s=30),
                                  bucket_bytes=4096, prefetch_buckets=1, device=torch.device("cpu"))
    assert stats.replicated_tensors == 5
    replicated = [c for c in calls if "layout" not in c]
    assert len(replicated) == 1 and "replicated tensors 1/1" in replicated[0], calls
    for name in extra:
        got = getattr(model, name)
        assert got.dtype == ref[name].dtype and got.shape == ref[name].shape and torch.equal(got, ref[name]), name
    # a budget smaller than the buffers together: several groups, each one collective
    from accelerate_memsafe.distributed.transport import replicated_groups

    entries = [(n, model, n, t, False) for n, t in extra.items()]
    assert [len(g) for g in replicated_groups(entries, 16)] == [1, 2, 1, 1]  # the empty one fits anywhere
    assert all(at % 16 == 0 for g in replicated_groups(entries, 4096) for _, at, _ in g)


def test_a_short_wait_polls_often_and_a_long_one_backs_off(group, monkeypatch):
    # a small exchange between ranks that arrive together takes about a millisecond on gloo: the poll's sleep
    # must not add up to its own length to it (at most _SHORT_MAX_SLEEP_S in the first _SHORT_WAIT_S), while a
    # long transfer is polled at most every _MAX_SLEEP_S
    import time

    from accelerate_memsafe.distributed import collectives as C

    class Work:  # completes 30 ms after it was issued
        def __init__(self) -> None:
            self.end = time.monotonic() + 0.030

        def is_completed(self) -> bool:
            return time.monotonic() >= self.end

        def wait(self, timeout=None) -> bool:
            return True

    sleeps: list[tuple[float, float]] = []  # (time since the op started, sleep asked)
    real_sleep = time.sleep
    coll = C.Collectives("poll", timeout_s=30)
    started = time.monotonic()

    def sleep(s: float) -> None:
        sleeps.append((time.monotonic() - started, s))
        real_sleep(s)

    monkeypatch.setattr(C.time, "sleep", sleep)
    coll._wait(Work(), "a 30 ms op", started)
    early = [s for at, s in sleeps if at < C._SHORT_WAIT_S - 1e-3]
    late = [s for at, s in sleeps if at > C._SHORT_WAIT_S + 2e-3]
    assert early and max(early) <= C._SHORT_MAX_SLEEP_S
    assert late and max(late) == C._MAX_SLEEP_S > C._SHORT_MAX_SLEEP_S


def test_parameters_fsdp_ignores_are_sent_whole_to_the_training_device(group):
    # `FullyShardedDataParallelPlugin(ignored_modules=...)`: fully_shard leaves those parameters whole (no DTensor);
    # they travel as replicated tensors, bitwise rank 0's, and land on `replicated_device` (the training device, also
    # under CPU offload, where the shards stay on the CPU): on `meta` here, which only the routing can put them on
    from torch.distributed.fsdp import fully_shard

    def build():
        torch.manual_seed(3)
        m = nn.Sequential(nn.Linear(5, 7), nn.Linear(7, 3))
        m.register_buffer("steps", torch.tensor([3, 1, 4]))
        ref = {k: v.clone() for k, v in m.state_dict().items()}
        originals = move_to_meta(m, [], weights_metadata(m), keep=True)
        fully_shard(m, ignored_params=set(m[1].parameters()))
        return m, ref, originals

    for target in (torch.device("cpu"), torch.device("meta")):
        model, ref, originals = build()
        stats = distribute_from_rank0(model, Rank0Source(originals), coll=Collectives("test", timeout_s=30),
                                      bucket_bytes=96, prefetch_buckets=1, device=torch.device("cpu"),
                                      replicated_device=target)
        assert stats.sharded_tensors == 2 and stats.replicated_tensors == 3
        for name in ("0.weight", "0.bias"):
            assert torch.equal(model.get_parameter(name).to_local(), ref[name]), name
        for name in ("1.weight", "1.bias", "steps"):
            got = model.get_parameter(name) if name != "steps" else model.steps
            assert not hasattr(got, "to_local") and got.device == target, (name, got.device)
            if target.type == "cpu":
                assert torch.equal(got, ref[name]), name
        assert isinstance(model[1].weight, nn.Parameter) and model[1].weight.requires_grad
