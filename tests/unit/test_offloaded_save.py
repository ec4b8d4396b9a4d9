"""``save_offloaded``: models dispatched on cpu + disk, whose transformers weight conversions fuse experts
(one-to-many on save) or chunk fused projections (many-to-one on save), saved with a shard size small
enough that conversion groups would straddle shards. The output must reload bitwise-equal; transformers'
own ``save_pretrained`` is run in the same setting and its observed behaviour asserted.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from accelerate_memsafe import save_offloaded
from accelerate_memsafe.errors import CheckpointError
from accelerate_memsafe.io.offload_reader import cpu_disk_device_map, is_offloaded, offloaded_names
from accelerate_memsafe.io.offloaded_save import INDEX_NAME, read_header, verify_written
from accelerate_memsafe.io.shard_plan import plan_offloaded_save

_DIMS = dict(vocab_size=128, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64)

#: model_type -> (config kwargs, kind). "fused_experts": load fuses per-expert tensors (save splits them);
#: "many_to_one": load chunks one checkpoint tensor (save must concatenate several model tensors).
MODELS = {
    "qwen3_moe": (dict(_DIMS, num_key_value_heads=2, moe_intermediate_size=16, num_experts=4,
                       num_experts_per_tok=2, head_dim=8), "fused_experts"),
    "mixtral": (dict(_DIMS, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2), "fused_experts"),
    "gte": (dict(_DIMS), "many_to_one"),
    "nomic_bert": (dict(_DIMS), "many_to_one"),
    "hrm_text": (dict(_DIMS), "many_to_one"),
}


def build_model(model_type: str, seed: int = 0):
    """A tiny randomly initialised transformers model of ``model_type`` (built from a config)."""
    from transformers import AutoConfig, AutoModel, AutoModelForCausalLM
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    if model_type not in CONFIG_MAPPING:  # transformers 5.17 has no gte
        pytest.skip(f"this transformers has no `{model_type}` model")
    kwargs, _ = MODELS[model_type]
    config = AutoConfig.for_model(model_type, **kwargs)
    torch.manual_seed(seed)
    try:
        return AutoModelForCausalLM.from_config(config)
    except ValueError:
        return AutoModel.from_config(config)


def load_offloaded(path: Path, offload_dir: Path, reference, cpu_fraction: float = 0.5):
    """``from_pretrained(path)`` dispatched with part of the blocks on cpu and the rest on disk."""
    device_map = cpu_disk_device_map(reference, cpu_fraction)
    return type(reference).from_pretrained(path, device_map=device_map, offload_folder=str(offload_dir))


@pytest.fixture(scope="module", params=list(MODELS))
def offloaded(request, tmp_path_factory):
    """(model_type, reference model, offloaded model, its original checkpoint dir)."""
    model_type = request.param
    root = tmp_path_factory.mktemp(model_type)
    reference = build_model(model_type)
    reference.save_pretrained(root / "orig")
    model = load_offloaded(root / "orig", root / "offload", reference, cpu_fraction=0.4)
    return model_type, reference, model, root


def _limit(model, model_type: str) -> int:
    """A ``max_shard_size`` under which conversion groups straddle shards in a naive split.

    Many-to-one on save: the smallest limit above the largest group for which the name-order split that
    ``save_pretrained`` uses (``split_torch_state_dict_into_shards``) separates the inputs of a reverse
    conversion. Fused experts (one fused tensor saved as many): a limit smaller than the group, so that its
    outputs cannot share one shard with anything.
    """
    from huggingface_hub import split_torch_state_dict_into_shards

    from accelerate_memsafe.io.shard_plan import saveable_state_dict

    plan = plan_offloaded_save(model, 10**12)
    largest = plan.largest_group_bytes
    if MODELS[model_type][1] == "fused_experts":
        return int(largest * 0.75)
    state_dict = saveable_state_dict(model)
    for limit in range(largest + 1000, 4 * largest, 500):
        where = split_torch_state_dict_into_shards(state_dict, max_shard_size=limit).tensor_to_filename
        if any(g.converted and len({where[s.name] for s in g.sources}) > 1 for g in plan.groups):
            return limit
    raise AssertionError(f"no shard size makes a conversion group of {model_type} straddle shards")


def _assert_bitwise_equal(model, reference):
    ref = reference.state_dict()
    got = model.state_dict()
    assert set(got) == set(ref)
    different = [k for k in ref if not torch.equal(got[k], ref[k])]
    assert not different, different


def test_model_is_offloaded_on_cpu_and_disk(offloaded):
    _, _, model, _ = offloaded
    assert set(model.hf_device_map.values()) == {"cpu", "disk"}
    assert is_offloaded(model)
    state = model.state_dict()
    assert {t.device.type for t in state.values()} == {"cpu", "meta"}
    # Converted tensors live both on cpu and on disk.
    converted = [s.name for g in plan_offloaded_save(model, 10**12).groups if g.converted for s in g.sources]
    assert {state[n].device.type for n in converted} == {"cpu", "meta"}
    assert set(offloaded_names(model)) == {n for n, t in state.items() if t.device.type == "meta"}


def test_save_offloaded_reloads_bitwise_equal(offloaded, tmp_path):
    model_type, reference, model, _ = offloaded
    limit = _limit(model, model_type)
    result = save_offloaded(model, tmp_path / "out", max_shard_size=limit, progress=False)
    plan = result.plan
    assert len(plan.shards) > 1
    assert any(g.converted for g in plan.groups), "the model type must have reverse conversions"
    reloaded = type(reference).from_pretrained(tmp_path / "out")
    _assert_bitwise_equal(reloaded, reference)
    assert (tmp_path / "out" / "config.json").exists()
    assert (tmp_path / "out" / "generation_config.json").exists() == reference.can_generate()
    # Saved names are the original checkpoint's names (conversions reverted), as save_pretrained writes them.
    original = json.loads((offloaded[3] / "orig" / "model.safetensors.index.json").read_text())["weight_map"] \
        if (offloaded[3] / "orig" / "model.safetensors.index.json").exists() else None
    if original is None:
        from safetensors import safe_open

        with safe_open(offloaded[3] / "orig" / "model.safetensors", "pt") as f:
            original = dict.fromkeys(f.keys())
    assert set(plan.weight_map) == set(original)


def test_written_files_index_and_shard_limit(offloaded, tmp_path):
    model_type, _, model, _ = offloaded
    limit = _limit(model, model_type)
    result = save_offloaded(model, tmp_path / "out", max_shard_size=limit, progress=False)
    out = tmp_path / "out"
    index = json.loads((out / INDEX_NAME).read_text())["weight_map"]
    files = sorted(p.name for p in out.glob("*.safetensors"))
    seen = {}
    for name in files:
        for key in read_header(out / name):
            assert key not in seen, f"{key} is in {seen.get(key)} and {name}"
            seen[key] = name
    # The index maps every saved tensor to the file that holds it, and nothing else.
    assert index == seen
    groups_by_output = {o.name: g for g in result.plan.groups for o in g.outputs}
    for name in files:
        size = (out / name).stat().st_size
        if size > limit:
            keys = set(read_header(out / name))
            group = groups_by_output[next(iter(keys))]
            assert keys == {o.name for o in group.outputs}, f"{name} is over the limit with more than one group"
    # Every conversion group is whole in one file.
    for group in result.plan.groups:
        assert len({seen[o.name] for o in group.outputs}) == 1


def test_tiny_limit_gives_single_group_oversized_shards(offloaded, tmp_path):
    _, reference, model, _ = offloaded
    result = save_offloaded(model, tmp_path / "out", max_shard_size=1000, progress=False)
    assert result.plan.oversized
    for shard in result.plan.shards:
        if shard.oversized:
            assert len(shard.groups) == 1
        size = (tmp_path / "out" / shard.filename).stat().st_size
        assert size <= 1000 or shard.oversized
    _assert_bitwise_equal(type(reference).from_pretrained(tmp_path / "out"), reference)


def test_what_transformers_save_pretrained_does(offloaded, tmp_path):
    """Observed with transformers 5.23: for a many-to-one reverse conversion whose inputs land in different
    shards, ``save_pretrained`` returns normally and writes truncated fused tensors under the same key into
    several files; ``from_pretrained`` then fails on the size mismatch. Fused-expert (one-to-many on save)
    models come out right."""
    model_type, reference, model, _ = offloaded
    limit = _limit(model, model_type)
    out = tmp_path / "tf"
    with pytest.warns(UserWarning, match="offloaded modules"):
        model.save_pretrained(out, max_shard_size=limit)
    holders: dict[str, list[str]] = {}
    for f in sorted(out.glob("*.safetensors")):
        for key in read_header(f):
            holders.setdefault(key, []).append(f.name)
    if MODELS[model_type][1] == "many_to_one":
        duplicated = {k: v for k, v in holders.items() if len(v) > 1}
        assert duplicated, "expected the same fused key in several shard files"
        with pytest.raises(RuntimeError, match="ignore_mismatched_sizes"):
            type(reference).from_pretrained(out)
    else:
        assert all(len(v) == 1 for v in holders.values())
        _assert_bitwise_equal(type(reference).from_pretrained(out), reference)


def test_verification_raises_on_header_mismatch(tmp_path):
    reference = build_model("gte")
    reference.save_pretrained(tmp_path / "orig")
    model = load_offloaded(tmp_path / "orig", tmp_path / "offload", reference)
    result = save_offloaded(model, tmp_path / "out", max_shard_size=20_000, progress=False)
    verify_written(tmp_path / "out", result.plan)  # as written: fine
    # Rewrite one shard with one tensor of another shape: the header no longer matches the plan.
    from safetensors.torch import load_file, save_file

    victim = result.plan.shards[-1]
    path = tmp_path / "out" / victim.filename
    tensors = load_file(path)
    name = victim.outputs[0].name
    tensors[name] = tensors[name].flatten()[:-1].clone()
    save_file(tensors, path, metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=rf"`{name}` is F32\["):
        verify_written(tmp_path / "out", result.plan)
    # A missing tensor and a stray one are reported too.
    tensors.pop(name)
    tensors["stray.weight"] = torch.zeros(2)
    save_file(tensors, path, metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"(?s)holds `stray.weight`.*is missing"):
        verify_written(tmp_path / "out", result.plan)


def test_converted_tensor_that_differs_from_plan_is_not_written(tmp_path, monkeypatch):
    from accelerate_memsafe import _compat

    reference = build_model("nomic_bert")
    reference.save_pretrained(tmp_path / "orig")
    model = load_offloaded(tmp_path / "orig", tmp_path / "offload", reference)
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "old.txt").write_text("previous")
    real = _compat.revert_conversions

    def truncating(m, sd):
        out = real(m, sd)
        if any(t.device.type != "meta" for t in sd.values()):
            return {k: (v[:-1] if "Wqkv" in k else v) for k, v in out.items()}
        return out

    monkeypatch.setattr(_compat, "revert_conversions", truncating)
    with pytest.raises(CheckpointError, match="Wqkv.*was not written"):
        save_offloaded(model, tmp_path / "out", max_shard_size=20_000, progress=False)
    # Nothing was put in place; the temporary directory is gone.
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["old.txt"]
    assert not any(p.name.startswith(".memsafe-tmp-") for p in tmp_path.iterdir())


def test_non_tensor_files_of_the_previous_checkpoint_are_kept(tmp_path):
    reference = build_model("qwen3_moe")
    reference.save_pretrained(tmp_path / "orig")
    model = load_offloaded(tmp_path / "orig", tmp_path / "offload", reference)
    out = tmp_path / "out"
    save_offloaded(model, out, max_shard_size=5_000, progress=False)
    (out / "tokenizer.json").write_text("{}")
    first = sorted(p.name for p in out.glob("*.safetensors"))
    save_offloaded(model, out, max_shard_size=10**9, progress=False)  # one shard now
    assert (out / "tokenizer.json").read_text() == "{}"
    assert sorted(p.name for p in out.glob("*.safetensors")) == ["model.safetensors"] != first
    _assert_bitwise_equal(type(reference).from_pretrained(out), reference)


def test_save_offloaded_accepts_transformers_size_strings(tmp_path):
    reference = build_model("gte")
    reference.save_pretrained(tmp_path / "orig")
    model = load_offloaded(tmp_path / "orig", tmp_path / "offload", reference)
    result = save_offloaded(model, tmp_path / "out", max_shard_size="0.02MB", progress=False)
    assert result.plan.max_shard_size == 20_000


def test_model_dispatched_by_accelerate_without_from_pretrained(tmp_path):
    # accelerate's big-model dispatch: no `_weight_conversions` (the mapping comes from the model type) and
    # accelerate's own disk offload (.dat files), not transformers' offload index.
    import copy

    from accelerate import dispatch_model

    reference = build_model("gte")
    model = dispatch_model(copy.deepcopy(reference), device_map=cpu_disk_device_map(reference, 0.4),
                           offload_dir=str(tmp_path / "offload"), main_device="cpu")
    assert is_offloaded(model) and getattr(model, "_weight_conversions", None) is None
    assert any(p.suffix == ".dat" for p in (tmp_path / "offload").iterdir())
    result = save_offloaded(model, tmp_path / "out", max_shard_size=20_000, progress=False)
    assert any(g.converted for g in result.plan.groups)
    _assert_bitwise_equal(type(reference).from_pretrained(tmp_path / "out"), reference)


def test_tied_weights_are_saved_once(tmp_path):
    from transformers import LlamaForCausalLM

    from accelerate_memsafe.models import build_llama

    reference = build_llama("tiny", tie_word_embeddings=True)
    reference.save_pretrained(tmp_path / "orig")
    model = LlamaForCausalLM.from_pretrained(tmp_path / "orig", device_map=cpu_disk_device_map(reference, 0.3),
                                             offload_folder=str(tmp_path / "offload"))
    result = save_offloaded(model, tmp_path / "out", max_shard_size=20_000, progress=False)
    assert "lm_head.weight" not in result.plan.weight_map
    reloaded = LlamaForCausalLM.from_pretrained(tmp_path / "out")
    assert reloaded.lm_head.weight is reloaded.model.embed_tokens.weight
    _assert_bitwise_equal(reloaded, reference)


def test_a_meta_tensor_without_an_offload_hook_is_refused_before_writing(tmp_path):
    with torch.device("meta"):
        model = build_model("gte")
    with pytest.raises(CheckpointError, match="no accelerate offload hook"):
        save_offloaded(model, tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()


def test_a_file_that_does_not_match_the_plan_fails_the_save_and_is_not_put_in_place(tmp_path, monkeypatch):
    from safetensors.torch import load_file, save_file

    from accelerate_memsafe.io import shard_writer

    reference = build_model("gte")
    reference.save_pretrained(tmp_path / "orig")
    model = load_offloaded(tmp_path / "orig", tmp_path / "offload", reference)
    real = shard_writer.sync_file

    def lossy(fd, path):  # a writer that silently drops a tensor from every file of more than one
        real(fd, path)
        tensors = load_file(path)
        if len(tensors) > 1:
            save_file(dict(sorted(tensors.items())[1:]), path, metadata={"format": "pt"})

    monkeypatch.setattr(shard_writer, "sync_file", lossy)
    with pytest.raises(CheckpointError, match=r"(?s)does not match its plan.*`embeddings.LayerNorm.bias` is missing"):
        save_offloaded(model, tmp_path / "out", max_shard_size=20_000, progress=False)
    assert not (tmp_path / "out").exists()


def test_progress_bar_counts_bytes(tmp_path, capsys):
    reference = build_model("gte")
    reference.save_pretrained(tmp_path / "orig")
    model = load_offloaded(tmp_path / "orig", tmp_path / "offload", reference)
    result = save_offloaded(model, tmp_path / "out", max_shard_size=20_000, progress=True)
    err = capsys.readouterr().err
    import re

    # tqdm with unit_scale: "101k/101k" bytes for the 100,992 planned bytes.
    done = re.search(r"Writing offloaded shards: 100%\|[^|]*\| ([\d.]+)k/\1k", err)
    assert done and round(float(done.group(1))) == round(result.plan.total_bytes / 1000)


def test_cpu_offload_hooks_are_read_like_disk_ones(tmp_path):
    # The path of `device_map={"...": "cpu"}` next to an accelerator: the values sit in the hook's cpu
    # weights map and the module holds `meta` tensors. `cpu_offload` builds exactly that on a CPU machine.
    import copy

    from accelerate import cpu_offload

    reference = build_model("nomic_bert")
    model = cpu_offload(copy.deepcopy(reference), execution_device=torch.device("cpu"))
    assert {t.device.type for t in model.state_dict().values()} == {"meta"}
    save_offloaded(model, tmp_path / "out", max_shard_size=20_000, progress=False)
    _assert_bitwise_equal(type(reference).from_pretrained(tmp_path / "out"), reference)
