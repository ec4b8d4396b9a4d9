"""The conversion-aware shard plan: grouping, packing, header-size bounds, and planning on meta tensors."""

from __future__ import annotations

import pytest
import torch

from accelerate_memsafe import _compat
from accelerate_memsafe.errors import CheckpointError
from accelerate_memsafe.io.shard_plan import (
    FILE_OVERHEAD_BYTES,
    ConversionGroup,
    TensorSpec,
    group_specs,
    pack_shards,
    plan_offloaded_save,
    shard_filenames,
)


def _group(*names: str, n: int = 250, dtype=torch.float32) -> ConversionGroup:
    specs = tuple(TensorSpec(name, (n,), dtype) for name in names)
    return ConversionGroup(specs, specs, converted=len(names) > 1)


def test_group_specs_keeps_conversion_inputs_together_in_natural_order():
    names = ["layers.10.q", "layers.2.k", "layers.2.q", "layers.10.k", "embed", "layers.2.norm"]
    specs = [TensorSpec(n, (4,), torch.float32) for n in names]

    def key(name):
        return name.rsplit(".", 1)[0] + ".qkv" if name.endswith((".q", ".k")) else None

    groups = [[s.name for s in g] for g in group_specs(specs, key)]
    assert groups == [["embed"], ["layers.2.k", "layers.2.q"], ["layers.2.norm"], ["layers.10.k", "layers.10.q"]]


def test_pack_shards_respects_the_limit_and_keeps_order():
    groups = [_group(f"t{i}") for i in range(7)]  # 1000 data bytes each
    plan = pack_shards(groups, 2500)
    assert [len(s.groups) for s in plan.shards] == [2, 2, 2, 1]
    assert [o.name for s in plan.shards for o in s.outputs] == [f"t{i}" for i in range(7)]
    assert all(s.file_bytes <= 2500 and not s.oversized for s in plan.shards)
    assert plan.shards[0].filename == "model-00001-of-00004.safetensors"
    assert plan.weight_map["t6"] == "model-00004-of-00004.safetensors"


def test_a_group_is_never_split_and_an_oversized_group_gets_its_own_shard():
    groups = [_group("a"), _group("b.q", "b.k", "b.v"), _group("c"), _group("d.q", "d.k", n=2000), _group("e")]
    plan = pack_shards(groups, 2500)
    layout = [[o.name for o in s.outputs] for s in plan.shards]
    # b (3000 bytes) does not fit next to a, nor alone: its own shard, flagged; d likewise.
    assert layout == [["a"], ["b.q", "b.k", "b.v"], ["c"], ["d.q", "d.k"], ["e"]]
    assert plan.oversized == [plan.shards[1].filename, plan.shards[3].filename]
    assert plan.largest_group_bytes == 16000
    assert plan.summary()["oversized_shards"] == plan.oversized


def test_single_shard_is_named_like_transformers():
    assert shard_filenames(1) == ["model.safetensors"]
    assert pack_shards([_group("a")], 10**6).shards[0].filename == "model.safetensors"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64, torch.bool])
def test_planned_file_bytes_bound_the_real_safetensors_file(tmp_path, dtype):
    from safetensors.torch import save_file

    shapes = [(3, 5), (7,), (), (1, 1, 9), (123, 4)]
    specs = [TensorSpec(f"model.layers.{i}.some_rather_long_name_{i}.weight", s, dtype) for i, s in enumerate(shapes)]
    group = ConversionGroup(tuple(specs), tuple(specs))
    plan = pack_shards([group], 10**9)
    save_file({s.name: torch.zeros(s.shape, dtype=dtype) for s in specs}, tmp_path / "x.safetensors", metadata={"format": "pt"})
    actual = (tmp_path / "x.safetensors").stat().st_size
    assert actual <= plan.shards[0].file_bytes
    # ...and not by much: the bound is per tensor, a few dozen bytes.
    assert plan.shards[0].file_bytes - actual < FILE_OVERHEAD_BYTES + 64 * len(specs)


def _meta_model(model_type: str):
    from transformers import AutoConfig, AutoModel
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    if model_type not in CONFIG_MAPPING:
        pytest.skip(f"this transformers has no `{model_type}` model")
    config = AutoConfig.for_model(model_type, vocab_size=64, hidden_size=16, num_hidden_layers=2,
                                  num_attention_heads=2, intermediate_size=32)
    with torch.device("meta"):
        return AutoModel.from_config(config)


def test_plan_reads_no_data_and_groups_the_reverse_concatenation():
    model = _meta_model("nomic_bert")  # every tensor on meta: the plan can only use names, shapes, dtypes
    plan = plan_offloaded_save(model, 2000)
    converted = [g for g in plan.groups if g.converted]
    assert [sorted(s.name for s in g.sources) for g in converted] == [
        ["layers.0.self_attn.k_proj.weight", "layers.0.self_attn.q_proj.weight", "layers.0.self_attn.v_proj.weight"],
        ["layers.1.self_attn.k_proj.weight", "layers.1.self_attn.q_proj.weight", "layers.1.self_attn.v_proj.weight"],
    ]
    assert [[(o.name, o.shape) for o in g.outputs] for g in converted] == [
        [("encoder.layers.0.attn.Wqkv.weight", (48, 16))],
        [("encoder.layers.1.attn.Wqkv.weight", (48, 16))],
    ]
    # Each q/k/v is 1024 bytes: a naive split at 2000 bytes would separate them; the plan does not.
    shard_of = plan.weight_map
    assert len({shard_of[o.name] for g in converted for o in g.outputs}) == 2
    assert [s.oversized for s in plan.shards if any(g.converted for g in s.groups)] == [True, True]


def test_without_original_format_nothing_is_converted():
    model = _meta_model("gte")
    plan = plan_offloaded_save(model, 10**6, save_original_format=False)
    assert not any(g.converted for g in plan.groups)
    assert set(plan.weight_map) == set(model.state_dict())


def test_grouping_that_disagrees_with_transformers_raises_before_writing(monkeypatch):
    model = _meta_model("gte")
    # Pretend no tensor needs another: q, k and v are then reverted one by one, which transformers' own
    # whole-model reversion contradicts.
    monkeypatch.setattr(_compat, "reverse_conversion_key", lambda m: (lambda name: None))
    with pytest.raises(CheckpointError, match="would both save `encoder.layer.0.mlp.up_gate_proj.weight`"):
        plan_offloaded_save(model, 10**6)


def test_per_group_result_that_differs_from_whole_model_reversion_raises(monkeypatch):
    model = _meta_model("gte")
    real = _compat.revert_conversions

    def forgetful(m, state_dict):  # loses the embedding LayerNorm when called on a single group
        out = real(m, state_dict)
        return out if len(state_dict) > 5 else {k: v for k, v in out.items() if "LayerNorm" not in k}

    monkeypatch.setattr(_compat, "revert_conversions", forgetful)
    with pytest.raises(CheckpointError, match=r"missing: \['embeddings.LayerNorm.bias', 'embeddings.LayerNorm.weight'\]"):
        plan_offloaded_save(model, 10**6)


def test_untested_transformers_version_warns():
    assert _compat.check_transformers_version(str(_compat.TESTED_TRANSFORMERS_CONVERSIONS[0])) is True
    with pytest.warns(UserWarning, match="tested with transformers"):
        assert _compat.check_transformers_version("9.0.0") is False


def test_transformers_still_groups_reverse_conversions_by_converter_target():
    # `_compat.reverse_conversion_key` mirrors this rule of `revert_weight_conversion`; if transformers changes
    # it, this test names the place (the plan's cross-check would also refuse to save).
    import inspect

    from transformers import core_model_loading

    src = inspect.getsource(core_model_loading.revert_weight_conversion)
    if hasattr(core_model_loading, "apply_converters"):  # 5.21 on: the name after at most one converter
        assert "apply_converters(original_key, converters)" in src
    else:  # before (5.17): that converter, then every renaming
        assert "rename_source_key(original_key, renamings, converters, reverse=True)" in src
    assert "conversion_mapping.setdefault(renamed_key, new_converter)" in src


def test_the_older_transformers_rule_groups_as_the_installed_one(monkeypatch):
    # transformers before `apply_converters` (5.17, the GPU machines' image) names a group by the name after the
    # converter and then every renaming: on these models the groups come out the same, and the plan's cross-check
    # against the installed `revert_weight_conversion` accepts them
    from types import SimpleNamespace

    from transformers import core_model_loading
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    calls = []

    def rename_source_key(*args, **kwargs):
        calls.append(kwargs.get("reverse"))
        return core_model_loading.rename_source_key(*args, **kwargs)

    older = SimpleNamespace(rename_source_key=rename_source_key)  # no apply_converters
    real = _compat._reverse_converter_rename
    for model_type in [t for t in ("nomic_bert", "gte") if t in CONFIG_MAPPING]:  # transformers 5.17 has no gte
        model = _meta_model(model_type)
        installed = plan_offloaded_save(model, 2000)
        with monkeypatch.context() as m:
            m.setattr(_compat, "_reverse_converter_rename", lambda cml=None: real(older))
            planned = plan_offloaded_save(model, 2000)
        assert [[s.name for s in g.sources] for g in planned.groups] == \
            [[s.name for s in g.sources] for g in installed.groups], model_type
        assert sum(g.converted for g in planned.groups) >= 2, model_type  # so the comparison can fail
    assert calls and set(calls) == {True}  # the older rule ran, in reverse
