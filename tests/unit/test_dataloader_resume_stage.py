"""The ``dataloader_resume`` stage on one process, against stock accelerate (``MemSafePlugin(stages=[])``):
the sampler wrapper passes ``set_epoch`` (and everything else) through, ``load_state`` loads what matches
when the script prepares other dataloaders than the run that saved, and a shuffled resume is exact."""

from __future__ import annotations

import warnings

import pytest
import torch
from accelerate.state import AcceleratorState, GradientState
from accelerate.utils import DataLoaderConfiguration
from torch.utils.data import DataLoader, RandomSampler

from accelerate_memsafe import Accelerator, MemSafePlugin
from accelerate_memsafe.io.resume import EpochStartRecorder

N = 20


def _fresh_accelerator(stock: bool, **config) -> Accelerator:
    # Each accelerator is a "fresh process": no state carried over from the previous one.
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    plugin = MemSafePlugin(stages=[]) if stock else MemSafePlugin()
    return Accelerator(plugins=[plugin], cpu=True, dataloader_config=DataLoaderConfiguration(**config))


def _shuffled(kind: str, seed: int = 9):
    data = torch.arange(N)
    if kind == "stateful":
        from torchdata.stateful_dataloader import StatefulDataLoader

        return StatefulDataLoader(data, batch_size=2, shuffle=True, generator=torch.Generator().manual_seed(seed))
    if kind == "random_sampler":
        return DataLoader(data, batch_size=2, sampler=RandomSampler(data, generator=torch.Generator().manual_seed(seed)))
    if kind == "no_generator":  # RandomSampler draws each epoch's seed from the global RNG
        return DataLoader(data, batch_size=2, shuffle=True)
    return DataLoader(data, batch_size=2, shuffle=True, generator=torch.Generator().manual_seed(seed))


def _epoch(dl) -> list[list[int]]:
    return [b.tolist() for b in dl]


# -- 1. set_epoch and the other sampler attributes reach the wrapped sampler ------------------------------
def _orders_with_set_epoch(stock: bool) -> list[list[list[int]]]:
    acc = _fresh_accelerator(stock, use_seedable_sampler=True)
    dl = acc.prepare(_shuffled("plain"))
    orders = []
    for epoch in (3, 3, 0, 1):
        dl.set_epoch(epoch)
        orders.append(_epoch(dl))
    return orders


def test_set_epoch_gives_the_same_orders_as_stock_accelerate():
    stock = _orders_with_set_epoch(stock=True)
    assert stock[0] == stock[1] and stock[0] != stock[2]
    ours = _orders_with_set_epoch(stock=False)
    assert ours == stock, "set_epoch(3) twice (and epochs 0, 1) must give stock accelerate's orders"


def test_sampler_wrapper_forwards_attributes_and_methods():
    from torchdata.stateful_dataloader.sampler import RandomSampler as StatefulRandomSampler

    inner = StatefulRandomSampler(range(6), generator=torch.Generator().manual_seed(0))
    wrapper = EpochStartRecorder(inner)
    assert wrapper.generator is inner.generator and wrapper.num_samples == 6 and wrapper.data_source is inner.data_source
    wrapper.epoch = 5  # writes go to the wrapped sampler too
    assert inner.epoch == 5 and wrapper.epoch == 5
    assert list(wrapper) == list(inner.__class__(range(6), generator=torch.Generator().manual_seed(0)))
    assert wrapper.epoch_start_state is not None and not hasattr(inner, "epoch_start_state")
    with pytest.raises(AttributeError):
        wrapper.no_such_attribute  # noqa: B018
    assert len(wrapper) == 6  # dunders too: schedulers are sized with len(train_dataloader)


def test_len_of_a_prepared_shuffled_dataloader_is_stock_accelerates(tmp_path):
    lengths = {}
    for stock in (False, True):
        acc = _fresh_accelerator(stock, use_stateful_dataloader=False)
        lengths[stock] = len(acc.prepare(_shuffled("dataloader")))
    assert lengths[False] == lengths[True] > 0


# -- 3. exact shuffled resume -------------------------------------------------------------------------------
def _reference_and_resumed(tmp_path, kind: str, stock: bool, steps: int = 3):
    ckpt = str(tmp_path / f"{kind}-{stock}")
    torch.manual_seed(0)  # a restarted script: the same global RNG for the plugin and for stock
    acc = _fresh_accelerator(stock, use_stateful_dataloader=True)
    dl = acc.prepare(_shuffled(kind))
    it = iter(dl)
    before = [next(it).tolist() for _ in range(steps)]
    acc.save_state(ckpt)
    reference = [b.tolist() for b in it] + _epoch(dl) + _epoch(dl)
    acc = _fresh_accelerator(stock, use_stateful_dataloader=True)
    dl = acc.prepare(_shuffled(kind))
    acc.load_state(ckpt)
    resumed = _epoch(dl) + _epoch(dl) + _epoch(dl)
    assert len(before) + len(reference) == 3 * N // 2
    return reference, resumed


@pytest.mark.parametrize("kind", ["stateful", "random_sampler", "no_generator"])
def test_shuffled_resume_is_exact(tmp_path, kind):
    reference, resumed = _reference_and_resumed(tmp_path, kind, stock=False)
    assert resumed == reference, "the batches after the resume differ from the uninterrupted run"


def test_a_generator_less_shuffle_draws_like_stock_and_stock_does_not_resume_it(tmp_path):
    """Without a generator the plugin draws each epoch's seed from the global RNG exactly as torch does
    (same batches, same RNG consumption as stock), and records it; stock replays with a new seed."""
    ours, stock = (_reference_and_resumed(tmp_path, "no_generator", stock=s) for s in (False, True))
    assert ours[0] == stock[0], "the uninterrupted batches differ from stock's"
    assert ours[1][: len(ours[0])] == ours[0] and stock[1][: len(stock[0])] != stock[0]


def test_shuffled_resume_matches_stock_where_stock_is_exact(tmp_path):
    ours = _reference_and_resumed(tmp_path, "random_sampler", stock=False)
    stock = _reference_and_resumed(tmp_path, "random_sampler", stock=True)
    assert stock[0] == stock[1] and ours == stock


# -- 2. a different number (or order) of prepared dataloaders -----------------------------------------------
def _save_train_and_eval(tmp_path, steps: int = 3):
    """Train (shuffled) and eval (sequential, 2 batches in) prepared in that order; saved mid-epoch."""
    ckpt = str(tmp_path / "ckpt")
    acc = _fresh_accelerator(False, use_stateful_dataloader=True)
    train, evaluation = acc.prepare(_shuffled("stateful"), DataLoader(torch.arange(10) + 100, batch_size=2))
    it, eval_it = iter(train), iter(evaluation)
    for _ in range(steps):
        next(it)
    eval_done = [next(eval_it).tolist() for _ in range(2)]
    acc.save_state(ckpt)
    return ckpt, [b.tolist() for b in it] + _epoch(train), [b.tolist() for b in eval_it], eval_done


def test_load_state_with_an_eval_loader_prepared_after_it(tmp_path):
    ckpt, train_ref, eval_ref, _ = _save_train_and_eval(tmp_path)
    acc = _fresh_accelerator(False, use_stateful_dataloader=True)
    train = acc.prepare(_shuffled("stateful"))
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        acc.load_state(ckpt)  # the checkpoint holds 2 dataloaders, 1 is prepared: loads it
    evaluation = acc.prepare(DataLoader(torch.arange(10) + 100, batch_size=2))  # restored when prepared
    assert _epoch(train) + _epoch(train) == train_ref
    assert _epoch(evaluation) == eval_ref
    record = next(r for r in acc.memsafe_plugin.report.find() if r.stage == "dataloader_resume" and r.hook == "load_state")
    assert record.status == "ran" and record.details["dataloaders"] == 1 and record.details["pending"] == 1


def test_load_state_with_more_dataloaders_than_saved(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    acc = _fresh_accelerator(False, use_stateful_dataloader=True)
    train = acc.prepare(_shuffled("stateful"))
    it = iter(train)
    for _ in range(3):
        next(it)
    acc.save_state(ckpt)
    reference = [b.tolist() for b in it]
    acc = _fresh_accelerator(False, use_stateful_dataloader=True)
    train, evaluation = acc.prepare(_shuffled("stateful"), DataLoader(torch.arange(10) + 100, batch_size=2))
    acc.load_state(ckpt)
    assert _epoch(train) == reference and _epoch(evaluation) == [[100 + i, 101 + i] for i in range(0, 10, 2)]


def test_load_state_with_dataloaders_prepared_in_another_order_loads_like_stock(tmp_path):
    ckpt, *_ = _save_train_and_eval(tmp_path)
    outcome = {}
    for stock in (True, False):
        acc = _fresh_accelerator(stock, use_stateful_dataloader=True)
        evaluation, train = acc.prepare(DataLoader(torch.arange(10) + 100, batch_size=2), _shuffled("stateful"))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            acc.load_state(ckpt)
        outcome[stock] = (_epoch(evaluation), _epoch(train), [str(w.message) for w in caught])
    assert outcome[False][:2] == outcome[True][:2], "the plugin must load what stock accelerate loads"
    assert any("dataloader 0: not restoring" in m for m in outcome[False][2]), outcome[False][2]


# -- 4. saves at an epoch boundary ----------------------------------------------------------------------------
def _boundary_reference_and_resumed(tmp_path, kind: str, config: dict, where: str, stock: bool = False):
    """Saved once epoch 0 has been yielded, ``where`` = "in" the loop (at its last batch) or "after" it; the
    two epochs after it, and a draw of the global RNG after them (what dropout would see)."""
    ckpt = str(tmp_path / f"{kind}-{where}-{stock}")

    def fresh():
        torch.manual_seed(0)
        acc = _fresh_accelerator(stock, **config)
        return acc, acc.prepare(_shuffled(kind))

    acc, dl = fresh()
    for _batch in dl:
        if where == "in" and dl.end_of_dataloader:
            acc.save_state(ckpt)
    if where == "after":
        acc.save_state(ckpt)
    reference = _epoch(dl) + _epoch(dl) + [torch.rand(2).tolist()]
    acc, dl = fresh()
    acc.load_state(ckpt)
    return reference, _epoch(dl) + _epoch(dl) + [torch.rand(2).tolist()]


@pytest.mark.parametrize("where", ["in", "after"])
@pytest.mark.parametrize(("kind", "config"), [
    ("stateful", {"use_stateful_dataloader": True}),  # torchdata, the loader's generator is the sampler's
    ("no_generator", {"use_stateful_dataloader": True}),  # torchdata's RandomSampler, base seed from the global RNG
    ("plain", {"use_stateful_dataloader": False}),
    ("plain", {"use_seedable_sampler": True}),  # the loop never calls set_epoch: accelerate's epoch count does
])
def test_a_save_at_an_epoch_boundary_resumes_exactly(tmp_path, kind, config, where):
    reference, resumed = _boundary_reference_and_resumed(tmp_path, kind, config, where)
    assert resumed == reference, "the epochs after the resume (or the global RNG after them) differ"
