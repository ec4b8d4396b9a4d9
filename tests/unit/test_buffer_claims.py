"""buffer_init's check from the rows every rank sent in the preflight exchange: no collective where every rank
kept its model in place and claimed rank 0's row; the collective otherwise; a loud error where a rank's buffers
changed after its claim."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from accelerate_memsafe.distributed.buffers import buffer_claim, init_non_persistent_buffers
from accelerate_memsafe.errors import StageError


class Rotary(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("inv_freq", 1.0 / (10000 ** (torch.arange(0, 8, 2).float() / 8)), persistent=False)


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.block = nn.Sequential(nn.Linear(4, 4), Rotary())


class Coll:
    """Collectives of one rank; ``peer_rows`` are the other ranks' rows of the check's all-gather."""

    def __init__(self, rank: int = 0, world_size: int = 2, peer_rows=None) -> None:
        self.rank, self.world_size, self.peer_rows, self.calls = rank, world_size, peer_rows, []

    def all_gather(self, tensor, *, what=""):
        self.calls.append((what, tensor.clone()))
        if self.peer_rows is None:
            raise AssertionError(f"unexpected collective: {what}")
        return [tensor.clone()] + [torch.tensor(r, dtype=torch.int64) for r in self.peer_rows]


def _claims(model, world_size=2):
    mine = buffer_claim(model)
    return mine, [mine.row] * world_size


def test_every_rank_claiming_rank0s_row_in_place_needs_no_collective():
    model = Model()
    mine, claims = _claims(model)
    coll = Coll()
    stats = init_non_persistent_buffers(model, coll=coll, device=torch.device("cpu"), claims=claims, mine=mine,
                                        untouched_everywhere=True)
    assert coll.calls == []
    assert stats.details() == {"recomputed": 0, "broadcast": 0, "verified": 1, "already_equal": 1,
                               "checked_in_preflight": True}


class _FullColl(Coll):
    """Every collective of the full path, on 2 ranks where rank 1 mirrors rank 0."""

    def all_gather(self, tensor, *, what=""):
        self.calls.append((what, tensor.clone()))
        return [tensor.clone(), tensor.clone()]

    def broadcast_object(self, obj, *, src=0, what=""):
        return obj

    def broadcast(self, tensor, *, src=0, what=""):
        pass


@pytest.mark.parametrize("case", ["not_in_place", "a_rank_differs"])
def test_without_the_proof_or_agreement_the_check_runs_its_collective_with_the_claimed_row(case):
    model = Model()
    mine, claims = _claims(model)
    if case == "a_rank_differs":
        claims[1] = (claims[0][0], claims[0][1] + 1, 1)
    coll = Coll(peer_rows=[list(mine.row)])
    stats = init_non_persistent_buffers(model, coll=coll, device=torch.device("cpu"), claims=claims, mine=mine,
                                        untouched_everywhere=case != "not_in_place")
    what, sent = coll.calls[0]
    assert what == "check of the non-persistent buffers against rank 0's"
    assert sent.tolist() == list(mine.row)  # the claimed row, reused: the buffers are the same tensors, unwritten
    assert stats.already_equal == 1 and not stats.checked_in_preflight


def test_a_non_finite_buffer_on_rank0_is_never_waved_through_by_the_claims():
    model = Model()
    model.block[1].inv_freq[0] = float("nan")
    mine, claims = _claims(model)  # every rank claims the same row, but it says "not usable"
    coll = _FullColl()
    with pytest.raises(StageError, match="`block.1.inv_freq` is not finite on rank"):
        init_non_persistent_buffers(model, coll=coll, device=torch.device("cpu"), claims=claims, mine=mine,
                                    untouched_everywhere=True)
    assert coll.calls[0][0] == "check of the non-persistent buffers against rank 0's"


def test_a_buffer_written_after_the_claim_is_a_loud_error_not_a_silent_pass():
    model = Model()
    mine, claims = _claims(model)
    model.block[1].inv_freq.mul_(2)  # a write: the claimed row no longer holds
    with pytest.raises(StageError, match=r"rank 1: the non-persistent buffers changed between the preflight"):
        init_non_persistent_buffers(model, coll=Coll(rank=1), device=torch.device("cpu"), claims=claims, mine=mine,
                                    untouched_everywhere=True)


def test_a_buffer_replaced_by_an_equal_tensor_or_renamed_by_checkpoint_wrapping_still_matches_its_claim():
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    model = Model()
    mine, claims = _claims(model)
    rot = model.block[1]
    rot.inv_freq = rot.inv_freq.clone()  # another tensor, the same bytes: the row is computed again and equal
    model.block = checkpoint_wrapper(model.block)  # names gain `_checkpoint_wrapped_module.`
    coll = Coll()
    stats = init_non_persistent_buffers(model, coll=coll, device=torch.device("cpu"), claims=claims, mine=mine,
                                        untouched_everywhere=True)
    assert coll.calls == [] and stats.checked_in_preflight


def test_a_model_without_non_persistent_buffers_claims_nothing():
    assert buffer_claim(nn.Linear(2, 2)).row is None
    stats = init_non_persistent_buffers(nn.Linear(2, 2), coll=Coll(), device=torch.device("cpu"), claims=[None, None],
                                        untouched_everywhere=True)
    assert stats.verified == 0


class _PlanReached(Exception):
    pass


class _StopAtPlan(Coll):
    def broadcast_object(self, obj, *, src=0, what=""):
        raise _PlanReached(what)


def test_a_buffer_replaced_after_the_claim_is_checked_as_it_is_now_not_as_claimed():
    # what `meta_placement` does on ranks > 0 when the weights do not stay in place; the old tensor is freed, and
    # CPython may give its id to the new one: the claim must not be taken for the buffer's present state
    model = Model()
    mine, claims = _claims(model)
    model.block[1]._buffers["inv_freq"] = torch.empty(4, device="meta")
    coll = _StopAtPlan(peer_rows=[list(mine.row)])
    with pytest.raises(_PlanReached):  # the check found a difference: rank 0's plan comes next
        init_non_persistent_buffers(model, coll=coll, device=torch.device("cpu"), claims=claims, mine=mine)
    sent = coll.calls[0][1].tolist()
    assert sent != list(mine.row) and sent[2] == 0  # the row of a buffer on meta: not usable


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.complex64])
def test_the_finiteness_read_from_the_exponent_bits_is_torch_isfinite(dtype):
    from accelerate_memsafe.distributed.buffers import _all_finite

    torch.manual_seed(0)
    specials = [0.0, -0.0, 1e-30, -3.5, float("inf"), float("-inf"), float("nan"), -float("nan"), 6e4]
    for value in specials:
        for size in (1, 5, 64):
            x = torch.randn(size, dtype=torch.float64)
            x[size // 2] = value
            x = x.to(dtype)
            assert _all_finite(x) == bool(torch.isfinite(x).all()), (dtype, value, size)
            wide = x.repeat(3).view(3, size).t()  # not contiguous
            assert _all_finite(wide) == bool(torch.isfinite(wide).all()), (dtype, value, size)
    assert _all_finite(torch.arange(5)) and _all_finite(torch.zeros(0, dtype=dtype))


def test_the_unnamed_walk_finds_the_buffers_of_the_named_one_in_its_order():
    # buffer_init first looks without building module paths; the fingerprint compares position by position
    from accelerate_memsafe.distributed.buffers import _non_persistent

    shared = Rotary()
    model = nn.Sequential(Model(), shared, nn.Sequential(shared, Rotary()), Model())
    model[3].block[1]._buffers["inv_freq"] = model[0].block[1].inv_freq  # one tensor under two modules
    named = _non_persistent(model)
    assert len(named) == 3  # the shared module and the shared tensor count once
    assert [(id(m), n, id(b)) for _, m, n, b in named] == [
        (id(m), n, id(b)) for _, m, n, b in _non_persistent(model, names=False)]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.complex64,
                                   torch.int64])
def test_the_check_read_once_as_bytes_is_the_check_of_finiteness_and_checksum(dtype):
    # _check reads a contiguous CPU float buffer once, through numpy, for both parts; other buffers go the long way
    from accelerate_memsafe.distributed.buffers import _all_finite, _check, _checksum

    base = torch.arange(-6, 6, dtype=torch.float64).reshape(3, 4) / 3
    cases = [base.to(dtype), base.to(dtype).t(), base.to(dtype)[:0]]
    if dtype.is_floating_point:
        for special in (float("nan"), float("inf"), -float("inf")):
            t = base.to(dtype).clone()
            t[1, 2] = special
            cases += [t, t.t()]
    for t in cases:
        assert _check(t) == [1 if _all_finite(t) else 0, _checksum(t)], (dtype, t)
    assert _check(torch.empty(3, device="meta")) == [0, -1]
