"""CPU-first in-place adapter reload: bitwise equality, bounded live memory, errors before any change."""

from __future__ import annotations

import os
import warnings

import pytest
import torch

peft = pytest.importorskip("peft")

from accelerate_memsafe import CheckpointError, MemoryBudgetError, reload_adapter  # noqa: E402
from accelerate_memsafe.integrations import peft as peft_helpers  # noqa: E402
from accelerate_memsafe.integrations.peft import reload_adapters  # noqa: E402
from accelerate_memsafe.memory.tracker import LiveTensorTracker  # noqa: E402


def _adapter_params(model) -> dict[str, torch.Tensor]:
    return {
        n: p.detach().clone()
        for n, p in model.named_parameters()
        if ".lora_" in n or ".modules_to_save." in n
    }


def _perturb(model) -> None:
    with torch.no_grad():
        for n, p in model.named_parameters():
            if ".lora_" in n or ".modules_to_save." in n:
                p.add_(1.0)


def _build(seed: int = 0, *, second: bool = True):
    from peft import LoraConfig, get_peft_model

    from accelerate_memsafe.models import build_llama

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.manual_seed(seed)
        model = get_peft_model(
            build_llama("tiny", seed=seed),
            LoraConfig(r=4, target_modules=["q_proj", "v_proj"], modules_to_save=["lm_head"], init_lora_weights=False),
        )
        if second:
            model.add_adapter(
                "other",
                LoraConfig(r=8, target_modules=["k_proj", "o_proj"], modules_to_save=["lm_head"], init_lora_weights=False),
            )
    return model


@pytest.fixture
def saved(tmp_path):
    """A two-adapter model with modules_to_save, saved with peft's save_pretrained, then perturbed."""
    model = _build()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model.save_pretrained(tmp_path / "ckpt")
    reference = _adapter_params(model)
    _perturb(model)
    return model, tmp_path / "ckpt", reference


def _assert_equal(model, reference, *, only: str | None = None) -> None:
    current = _adapter_params(model)
    names = [n for n in reference if only is None or f".{only}." in n]
    assert names
    for n in names:
        assert torch.equal(current[n], reference[n]), n


def test_reload_default_adapter_bitwise_and_leaves_other_untouched(saved):
    model, ckpt, reference = saved
    before = _adapter_params(model)
    stats = reload_adapter(model, ckpt)
    assert stats.file == str(ckpt / "adapter_model.safetensors")
    assert stats.tensors == 2 * 2 * 2 + 1  # 2 layers x (q, v) x (A, B) + lm_head
    _assert_equal(model, reference, only="default")
    other = [n for n in before if ".other." in n]
    assert other and all(torch.equal(_adapter_params(model)[n], before[n]) for n in other)


def test_reload_named_adapter_reads_its_subfolder(saved):
    model, ckpt, reference = saved
    stats = reload_adapter(model, ckpt, adapter_name="other")
    assert stats.file == str(ckpt / "other" / "adapter_model.safetensors")
    _assert_equal(model, reference, only="other")


def test_reload_all_adapters_with_modules_to_save(saved):
    model, ckpt, reference = saved
    stats = reload_adapters(model, ckpt)
    assert [os.path.relpath(s.file, ckpt) for s in stats] == ["adapter_model.safetensors", "other/adapter_model.safetensors"]
    _assert_equal(model, reference)
    assert any("modules_to_save" in n for n in reference)


def test_reload_keeps_training_mode_and_requires_grad(saved):
    model, ckpt, _ = saved
    model.train()
    grads = {n: p.requires_grad for n, p in model.named_parameters()}
    reload_adapters(model, ckpt)
    assert model.training
    assert grads == {n: p.requires_grad for n, p in model.named_parameters()}


@pytest.fixture
def many_tensors(tmp_path):
    """LoRA on every linear layer, no modules_to_save: many tensors of similar size."""
    from peft import LoraConfig, get_peft_model

    from accelerate_memsafe.models import build_llama

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = get_peft_model(build_llama("tiny"), LoraConfig(r=16, target_modules="all-linear", init_lora_weights=False))
        model.save_pretrained(tmp_path / "ckpt")
    reference = _adapter_params(model)
    _perturb(model)
    entries = peft_helpers.read_safetensors_header(tmp_path / "ckpt" / "adapter_model.safetensors")
    largest = max(e.nbytes for e in entries.values())
    whole = sum(e.nbytes for e in entries.values())
    assert whole > 10 * largest  # otherwise the bound below would not tell the two paths apart
    return model, tmp_path / "ckpt", reference, largest, whole


def test_peak_live_tensor_bytes_is_one_tensor(many_tensors):
    model, ckpt, reference, largest, _ = many_tensors
    with LiveTensorTracker() as tracker:
        reload_adapter(model, ckpt)
    assert 0 < tracker.peak_bytes <= 1.05 * largest
    _assert_equal(model, reference)


def test_at_most_one_source_tensor_alive_at_a_time(many_tensors, monkeypatch):
    """Structural check independent of the dispatch tracker: every tensor read from the file is dead
    before the next one is read (weak references to the very objects the reload holds)."""
    import weakref

    import safetensors

    model, ckpt, reference, _, _ = many_tensors
    alive_at_read: list[int] = []
    refs: list[weakref.ref] = []
    real_open = safetensors.safe_open

    class Spy:
        def __init__(self, *args, **kwargs):
            self._cm = real_open(*args, **kwargs)

        def __enter__(self):
            self._f = self._cm.__enter__()
            return self

        def __exit__(self, *exc):
            return self._cm.__exit__(*exc)

        def get_tensor(self, key):
            alive_at_read.append(sum(r() is not None for r in refs))
            t = self._f.get_tensor(key)
            refs.append(weakref.ref(t))
            return t

    monkeypatch.setattr(safetensors, "safe_open", Spy)
    reload_adapter(model, ckpt)
    assert len(alive_at_read) > 10 and max(alive_at_read) == 0
    _assert_equal(model, reference)


def test_peft_load_adapter_holds_the_whole_adapter(many_tensors, monkeypatch):
    """The reference: peft's own path holds the whole adapter state dict at once before copying it.

    Measured by wrapping ``load_peft_weights`` (its result is alive while ``set_peft_model_state_dict``
    copies it): the dispatch tracker cannot see tensors that safetensors' ``load_file`` builds.
    """
    import peft.peft_model

    model, ckpt, _, _, whole = many_tensors
    held = []
    original = peft.peft_model.load_peft_weights

    def spy(*args, **kwargs):
        out = original(*args, **kwargs)
        held.append(sum(t.numel() * t.element_size() for t in out.values()))
        return out

    monkeypatch.setattr(peft.peft_model, "load_peft_weights", spy)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model.load_adapter(str(ckpt), "default", torch_device="cpu")
    assert held == [whole]


def _unchanged(model, before) -> bool:
    now = _adapter_params(model)
    return all(torch.equal(now[n], before[n]) for n in before)


def test_missing_file_names_the_path(saved, tmp_path):
    model, _, _ = saved
    before = _adapter_params(model)
    with pytest.raises(CheckpointError, match=r"empty/other/adapter_model\.safetensors.*does not exist"):
        reload_adapter(model, tmp_path / "empty", adapter_name="other")
    assert _unchanged(model, before)


def test_truncated_file_names_file_and_tensor_before_any_change(saved):
    model, ckpt, _ = saved
    path = ckpt / "other" / "adapter_model.safetensors"
    size = path.stat().st_size
    with open(path, "r+b") as f:
        f.truncate(size - 100)
    before = _adapter_params(model)
    # the default adapter is valid and listed first: nothing may be copied into it either
    with pytest.raises(CheckpointError, match=r"other/adapter_model\.safetensors.*truncated: tensor `base_model\.model\.[\w.]+`"):
        reload_adapters(model, ckpt)
    assert _unchanged(model, before)


def test_truncated_header_is_refused(saved):
    model, ckpt, _ = saved
    path = ckpt / "adapter_model.safetensors"
    with open(path, "r+b") as f:
        f.truncate(20)
    with pytest.raises(CheckpointError, match="adapter_model.safetensors.*truncated"):
        reload_adapter(model, ckpt)


def test_shape_mismatch_names_file_and_tensor(saved, tmp_path):
    model, _, _ = saved
    from peft import LoraConfig

    other = _build(seed=1, second=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        other.add_adapter("other", LoraConfig(r=2, target_modules=["k_proj", "o_proj"], modules_to_save=["lm_head"]))
        other.save_pretrained(tmp_path / "rank2")
    before = _adapter_params(model)
    with pytest.raises(CheckpointError, match=r"rank2/other/adapter_model\.safetensors.*tensor `.*lora_[AB]\.weight` has shape \[\d+, \d+\] in the file but \[\d+, \d+\]"):
        reload_adapter(model, tmp_path / "rank2", adapter_name="other")
    assert _unchanged(model, before)


def test_missing_and_unknown_tensors_are_named(saved, tmp_path):
    from safetensors.torch import load_file, save_file

    model, ckpt, _ = saved
    tensors = load_file(ckpt / "adapter_model.safetensors")
    dropped = sorted(tensors)[0]
    (tmp_path / "missing").mkdir()
    save_file({k: v for k, v in tensors.items() if k != dropped}, tmp_path / "missing" / "adapter_model.safetensors")
    with pytest.raises(CheckpointError, match=rf"missing/adapter_model\.safetensors.*lacks 1 tensor.*`{dropped}`"):
        reload_adapter(model, tmp_path / "missing")
    (tmp_path / "extra").mkdir()
    save_file({**tensors, "base_model.model.bogus.weight": torch.zeros(2)}, tmp_path / "extra" / "adapter_model.safetensors")
    with pytest.raises(CheckpointError, match=r"extra/adapter_model\.safetensors.*`base_model\.model\.bogus\.weight`"):
        reload_adapter(model, tmp_path / "extra")


def test_memory_precheck_raises_in_gib_before_any_copy(saved, monkeypatch):
    model, ckpt, _ = saved
    monkeypatch.setattr(peft_helpers, "device_memory", lambda device: (1024, 80 * 2**30))
    before = _adapter_params(model)
    with pytest.raises(MemoryBudgetError, match=r"needs 0\.000 GiB.*only 0\.000 GiB of 80\.000 GiB are free.*Nothing was copied.*empty_cache"):
        reload_adapter(model, ckpt)
    assert _unchanged(model, before)
    reload_adapter(model, ckpt, check_memory=False)
    assert not _unchanged(model, before)


def test_not_a_peft_model_is_refused(tmp_path):
    with pytest.raises(CheckpointError, match="expected a peft `PeftModel`.*Linear"):
        reload_adapter(torch.nn.Linear(2, 2), tmp_path)


def test_unknown_adapter_name(saved):
    model, ckpt, _ = saved
    with pytest.raises(CheckpointError, match=r"no adapter named 'nope'.*\['default', 'other'\]"):
        reload_adapter(model, ckpt, adapter_name="nope")


def test_reload_state_dict_file_from_accelerate_layout(saved, tmp_path):
    """accelerate's save_state writes the whole PeftModel state dict under the model's own keys."""
    from safetensors.torch import save_model

    model, _, _ = saved
    save_model(model, str(tmp_path / "model.safetensors"))
    full = {k: v.detach().clone() for k, v in model.state_dict().items()}
    _perturb(model)
    with LiveTensorTracker() as tracker:
        stats = peft_helpers.reload_state_dict_file(model, tmp_path / "model.safetensors")
    assert all(torch.equal(model.state_dict()[k], v) for k, v in full.items())
    assert tracker.peak_bytes <= 1.05 * stats.largest_tensor_bytes


def test_local_index_of_plain_tensor_is_none():
    assert peft_helpers._local_index(torch.zeros(3)) is None


@pytest.mark.gpu
def test_reload_into_cuda_parameters(saved):
    model, ckpt, reference = saved
    model.cuda()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    stats = reload_adapters(model, ckpt)
    assert torch.cuda.max_memory_allocated() - base <= max(s.largest_tensor_bytes for s in stats)
    current = _adapter_params(model)
    assert all(torch.equal(current[n].cpu(), reference[n]) for n in reference)
