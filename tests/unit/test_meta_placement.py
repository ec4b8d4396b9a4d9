"""meta_placement's plain functions and stage decisions, single process."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from accelerate_memsafe import MemSafePlugin
from accelerate_memsafe.distributed.meta import move_to_meta, parallelism_blocks_meta_placement, weights_metadata
from accelerate_memsafe.pipeline import HookContext
from accelerate_memsafe.stages.buffer_init import BufferInitStage
from accelerate_memsafe.stages.meta_placement import MetaPlacementStage
from accelerate_memsafe.stages.rank0_distribute import Rank0DistributeStage


class Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(10, 4)
        self.head = nn.Linear(4, 10, bias=False)
        self.head.weight = self.emb.weight
        self.register_buffer("persist", torch.arange(3.0))
        self.register_buffer("scratch", torch.ones(2), persistent=False)


def test_move_to_meta_keeps_ties_optimizer_refs_and_originals():
    model = Tied()
    before = model.emb.weight.detach().clone()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    meta = weights_metadata(model)
    assert [m.name for m in meta] == ["emb.weight", "persist"]  # tied once; non-persistent excluded
    originals = move_to_meta(model, [opt], meta, keep=True)
    assert model.emb.weight.is_meta and model.head.weight is model.emb.weight
    assert model.persist.is_meta and not model.scratch.is_meta, "non-persistent buffers are left alone"
    assert opt.param_groups[0]["params"][0] is model.emb.weight
    assert torch.equal(originals["emb.weight"], before) and torch.equal(originals["persist"], torch.arange(3.0))


def test_move_to_meta_adopts_rank0_dtypes_and_keeps_nothing_off_rank0():
    model = Tied()
    ref = [type(m)(m.name, m.shape, torch.bfloat16, m.is_param, False, m.requires_grad) for m in weights_metadata(model)]
    assert move_to_meta(model, [], ref, keep=False) == {}
    assert model.emb.weight.dtype == torch.bfloat16 and model.emb.weight.requires_grad


def test_move_to_meta_adopts_rank0_requires_grad():
    # transformers' from_pretrained (rank 0) unfreezes what a model's __init__ froze (Whisper's sinusoidal
    # positions), a model built from the config (other ranks) keeps it frozen: FSDP2 then reduce-scatters
    # different sizes in the first backward and gloo aborts every rank
    model = Tied()
    ref = [type(m)(m.name, m.shape, m.dtype, m.is_param, False, False) for m in weights_metadata(model)]
    move_to_meta(model, [], ref, keep=False)
    assert not model.emb.weight.requires_grad and model.head.weight is model.emb.weight


def test_any_fsdp2_mesh_applies_and_already_distributed_models_are_declined_with_a_reason():
    class PC:
        tp_size, dp_replicate_size, sp_size = 2, 2, 1

    assert parallelism_blocks_meta_placement(nn.Linear(2, 2), PC()) is None  # HSDP / TP layouts are distributed
    assert parallelism_blocks_meta_placement(nn.Linear(2, 2), None) is None
    PC.sp_size = 2
    assert "sp_size=2" in parallelism_blocks_meta_placement(nn.Linear(2, 2), PC())

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import distribute_tensor, Replicate

    from tests.spawn import free_port

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    model = nn.Linear(2, 2)  # parallelised while loading: its parameters are DTensors
    model.weight = nn.Parameter(distribute_tensor(model.weight.detach(), init_device_mesh("cpu", (1,)), [Replicate()]))
    assert "already distributed (`weight` is a DTensor" in parallelism_blocks_meta_placement(model, None)


def _ctx(**kw):
    base = dict(hook="prepare", rank=0, world_size=2, device=torch.device("cpu"), options=MemSafePlugin(), model=nn.Linear(2, 2), is_fsdp2=True)
    base.update(kw)
    return HookContext(**base)


def test_stages_skip_with_reasons_when_they_do_not_apply():
    plugin = MemSafePlugin()
    assert MetaPlacementStage(plugin).skip_reason(_ctx(is_fsdp2=False)) == "not an FSDP2 run"
    assert MetaPlacementStage(plugin).skip_reason(_ctx(model=None)) == "no model passed to prepare"
    assert "single process" in MetaPlacementStage(plugin).skip_reason(_ctx(world_size=1))
    assert MetaPlacementStage(plugin).skip_reason(_ctx()) is None
    assert "meta_placement" in Rank0DistributeStage(plugin).skip_reason(_ctx())
    assert BufferInitStage(plugin).skip_reason(_ctx(world_size=1)) == "single process: nothing to synchronise"


def test_meta_placement_walks_the_model_once_per_hook_call_for_its_skip_reason(monkeypatch):
    """The accelerator, ``announce`` and the pipeline each ask, and the preflight's estimate counts the parameters:
    one walk per model and hook call answers all four."""
    from accelerate_memsafe import walk

    walks = []
    real = walk.parameters
    monkeypatch.setattr(walk, "parameters", lambda m: walks.append(1) or real(m))
    stage, ctx = MetaPlacementStage(MemSafePlugin()), _ctx()
    assert [stage.skip_reason(ctx) for _ in range(3)] == [None] * 3 and len(walks) == 1
    held = sum(p.numel() * p.element_size() for p in ctx.model.parameters())
    assert stage.estimate(ctx).cpu_bytes > 0 and len(walks) == 1  # the list the skip check walked
    assert stage._parameters(ctx) == list(ctx.model.parameters()) and len(walks) == 1
    assert sum(p.numel() * p.element_size() for p in stage._parameters(ctx)) == held
    ctx.model = nn.Linear(3, 3)  # another model (a stage replaced it): asked again
    assert stage.skip_reason(ctx) is None and len(walks) == 2
    assert stage._parameters(ctx) == list(ctx.model.parameters()) and len(walks) == 2
    assert stage.skip_reason(_ctx()) is None and len(walks) == 3  # a new hook call: a new context


def test_default_pipeline_order_and_validation():
    assert MemSafePlugin().stage_names("prepare")[:4] == ("meta_placement", "shard", "rank0_distribute", "buffer_init")
    import pytest

    from accelerate_memsafe import PipelineError

    with pytest.raises(PipelineError, match="`rank0_distribute` requires `shard`"):
        MemSafePlugin(stages=["meta_placement", "rank0_distribute"])
    with pytest.raises(PipelineError, match="`meta_placement` must run before `shard`"):
        MemSafePlugin(stages=["shard", "meta_placement"])


def test_from_pretrained_single_process_loads_and_remembers_the_checkpoint(tiny_llama_dir):
    from transformers import AutoModelForCausalLM

    import accelerate_memsafe

    model = accelerate_memsafe.from_pretrained(AutoModelForCausalLM, tiny_llama_dir, dtype=torch.float32)
    assert not model.model.embed_tokens.weight.is_meta
    assert model._memsafe_checkpoint == str(tiny_llama_dir)


def test_build_on_meta_matches_the_loaded_model(tiny_llama_dir):
    from transformers import AutoModelForCausalLM, LlamaForCausalLM

    from accelerate_memsafe.loading import _build_on_meta

    ref = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32)
    for cls in (AutoModelForCausalLM, LlamaForCausalLM):
        meta = _build_on_meta(cls, tiny_llama_dir, {"dtype": torch.float32, "device_map": "cpu"})
        assert [(m.name, m.shape, m.dtype) for m in weights_metadata(meta)] == [
            (m.name, m.shape, m.dtype) for m in weights_metadata(ref)
        ]
        assert all(p.is_meta for p in meta.parameters())
        assert torch.equal(meta.model.rotary_emb.inv_freq, ref.model.rotary_emb.inv_freq), "real buffers"
        assert not meta.training


def test_a_single_process_prepare_refuses_a_model_on_meta_with_the_reason(monkeypatch):
    # one process without FSDP: `meta_placement` does not run (nothing to distribute), so nothing fills the weights;
    # accelerate's own `model.to(device)` refuses them, as stock does, and the plugin then names them (it does not walk
    # the model before the call: that walk would cost a prepare of a few milliseconds a tenth of its wall)
    import accelerate

    from accelerate_memsafe import Accelerator, ConfigError, MemSafePlugin

    def meta_model_and_optimizer():
        with torch.device("meta"):
            model = torch.nn.Linear(3, 4)
        return model, torch.optim.SGD(model.parameters(), lr=0.1)

    with pytest.raises(NotImplementedError, match="Cannot copy out of meta tensor") as stock:
        accelerate.Accelerator(cpu=True).prepare(*meta_model_and_optimizer())
    acc = Accelerator(plugins=[MemSafePlugin()], cpu=True)
    model, opt = meta_model_and_optimizer()
    with pytest.raises(ConfigError, match=r"the model holds weights on `meta` \(no data\): 2 tensor\(s\), e\.g\. `weight`, "
                                          r"`bias`; accelerate's own `prepare` failed on them \(Cannot copy out of meta "
                                          r"tensor.*`meta_placement` does not run here \(.+\)") as err:
        acc.prepare(model, opt)
    assert isinstance(err.value.__cause__, type(stock.value)), "accelerate's own error is the cause"
    assert model.weight.is_meta and model.bias.is_meta
    failed = [(r.stage, r.status) for r in acc.memsafe_plugin.report.records if r.status != "skipped"]
    assert failed == [("accelerate.prepare", "failed")]
    # an error of accelerate's call on a model with real weights is not about meta weights: it passes through as it is
    def boom(self, *args, **kwargs):
        raise RuntimeError("boom")

    monkeypatch.setattr(accelerate.Accelerator, "prepare_model", boom)
    real = torch.nn.Linear(3, 4)
    with pytest.raises(RuntimeError, match="^boom\n"):
        Accelerator(plugins=[MemSafePlugin()], cpu=True).prepare(real, torch.optim.SGD(real.parameters(), lr=0.1))


def test_meta_placement_lets_go_of_the_parameter_list_when_it_runs():
    """The skip check's parameter list holds every original weight: once the stage has run, the hook's context must
    not keep it (else ``shard`` could not free the unsharded weights, and their release would fall at the end of
    the hook)."""
    from accelerate_memsafe.pipeline import ANNOUNCED_KEY
    from accelerate_memsafe.stages import meta_placement as mp

    stage, ctx = MetaPlacementStage(MemSafePlugin()), _ctx()
    assert stage.skip_reason(ctx) is None and ctx.scratch[mp._SKIP_KEY][2] is not None
    token = (("/ckpt.safetensors",), ("id",), "digest")
    ctx.scratch[ANNOUNCED_KEY] = {"meta_placement": [(token, None), (token, None)]}
    ctx.scratch[mp._CLAIM_KEY] = True
    outcome = stage.run(ctx)
    assert outcome.details == {"in_place": True, "tensors": 2}
    assert ctx.scratch[mp._SKIP_KEY][2] is None and ctx.scratch[mp._SKIP_KEY][1] is None
