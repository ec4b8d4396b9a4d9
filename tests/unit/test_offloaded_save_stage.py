"""The ``offloaded_save`` stage at ``accelerator.save_model``."""

from __future__ import annotations

import json

import pytest
import torch

from accelerate_memsafe import Accelerator, MemSafePlugin
from accelerate_memsafe.io import atomic
from accelerate_memsafe.io.offloaded_save import INDEX_NAME, read_header
from accelerate_memsafe.pipeline import HookContext
from accelerate_memsafe.stages.offloaded_save import OffloadedSaveStage
from tests.unit.test_offloaded_save import build_model, load_offloaded


@pytest.fixture(scope="module")
def gte(tmp_path_factory):
    root = tmp_path_factory.mktemp("gte-stage")
    reference = build_model("gte")
    reference.save_pretrained(root / "orig")
    return reference, load_offloaded(root / "orig", root / "offload", reference)


def _equal(path, reference):
    reloaded = type(reference).from_pretrained(path)
    ref = reference.state_dict()
    return all(torch.equal(t, ref[k]) for k, t in reloaded.state_dict().items())


def test_stage_is_in_the_default_pipeline_at_save_model():
    assert "offloaded_save" in MemSafePlugin().stage_names("save_model")


def test_save_model_routes_an_offloaded_model_through_the_stage(gte, tmp_path):
    reference, model = gte
    plugin = MemSafePlugin(stages=["offloaded_save"], max_shard_size=20_000, progress=False)
    accelerator = Accelerator(plugins=[plugin])
    accelerator.save_model(model, tmp_path / "out")
    records = plugin.report.find(hook="save_model")
    assert [r.stage for r in records] == ["offloaded_save"]  # accelerate's save_model did not run
    record = records[0]
    assert record.status == "ran"
    assert record.details["max_shard_size"] == 20_000
    # qkv weight, qkv bias and up_gate, in each of the 2 layers
    assert record.details["shards"] > 1 and record.details["conversion_groups"] == 6
    assert record.cpu_anon_peak_bytes is not None and record.wall_s > 0
    assert _equal(tmp_path / "out", reference)


def test_max_shard_size_passed_to_save_model_wins(gte, tmp_path):
    _, model = gte
    plugin = MemSafePlugin(stages=["offloaded_save"], progress=False)
    Accelerator(plugins=[plugin]).save_model(model, tmp_path / "out", max_shard_size="30KB")
    assert plugin.report.find(stage="offloaded_save")[0].details["max_shard_size"] == 30_000
    for f in (tmp_path / "out").glob("*.safetensors"):
        assert f.stat().st_size <= 30_000 or len(read_header(f)) == 1


def test_a_model_that_is_not_offloaded_is_left_to_accelerate(tmp_path):
    model = build_model("gte")
    plugin = MemSafePlugin(stages=["offloaded_save"], progress=False)
    Accelerator(plugins=[plugin]).save_model(model, tmp_path / "out")
    records = {r.stage: r for r in plugin.report.find(hook="save_model")}
    assert records["offloaded_save"].status == "skipped"
    assert records["offloaded_save"].reason == "model is not offloaded"
    assert records["accelerate.save_model"].status == "ran"
    assert (tmp_path / "out" / "model.safetensors").exists()


def test_stage_writes_into_a_temporary_directory_owned_by_atomic_checkpoint(gte, tmp_path):
    # `atomic_checkpoint` runs first and points ctx.directory at its temporary directory; we write there
    # and leave the swap to it.
    reference, model = gte
    final = tmp_path / "final"
    temp = atomic.temp_dir_for(final)
    atomic.begin(temp)
    plugin = MemSafePlugin(stages=["offloaded_save"], max_shard_size=20_000, progress=False)
    ctx = HookContext(hook="save_model", rank=0, world_size=1, device=torch.device("cpu"), options=plugin,
                      model=model, directory=str(temp))
    outcome = OffloadedSaveStage(plugin).run(ctx)
    assert outcome.status == "ran" and ctx.skip_upstream
    assert not final.exists()
    index = json.loads((temp / INDEX_NAME).read_text())["weight_map"]
    assert set(index.values()) == {p.name for p in temp.glob("*.safetensors")}
    atomic.finalize(temp, final, world_size=1)
    assert _equal(final, reference)


def test_with_atomic_checkpoint_the_checkpoint_is_swapped_in_by_that_stage(gte, tmp_path):
    reference, model = gte
    plugin = MemSafePlugin(stages=["atomic_checkpoint", "offloaded_save"], max_shard_size=20_000, progress=False)
    out = tmp_path / "out"
    out.mkdir()
    (out / "tokenizer.json").write_text("{}")
    Accelerator(plugins=[plugin]).save_model(model, out)
    records = {r.stage: r for r in plugin.report.find(hook="save_model")}
    assert set(records) == {"atomic_checkpoint", "offloaded_save"}
    assert all(r.status == "ran" for r in records.values())
    assert atomic.check_loadable(out) is not None  # marked complete by atomic_checkpoint
    assert (out / "tokenizer.json").read_text() == "{}"
    assert _equal(out, reference)


def test_atomic_checkpoint_after_offloaded_save_is_refused_when_the_plugin_is_built():
    from accelerate_memsafe.errors import PipelineError

    with pytest.raises(PipelineError, match="move `atomic_checkpoint` before `offloaded_save`"):
        MemSafePlugin(stages=["offloaded_save", "atomic_checkpoint"])
