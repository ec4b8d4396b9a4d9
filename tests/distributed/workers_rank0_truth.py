"""Workers for tests/distributed/test_rank0_truth.py: rank 0 edits its model in place after loading it,
then ``prepare`` runs with the plugin. Module level so that spawn can pickle them."""

from __future__ import annotations

import mmap
from typing import Any

import torch
from torch import nn

from tests.distributed.workers_prepare import _accelerator, _describe

PAGE = mmap.PAGESIZE
#: The edits rank 0 makes, by kind: the whole tensor set to 1 (the measured bug), three elements in the
#: middle of a large tensor, and a whole small tensor that does not start on a page boundary.
EDITS = {
    "whole": "lm_head.weight",
    "middle": "model.layers.0.mlp.gate_proj.weight",
    "unaligned": "model.layers.1.input_layernorm.weight",
}


def _edit(model: nn.Module, kind: str, name: str) -> tuple[int, int]:
    """Edits ``name`` in place (same storage, same address); returns the element range written."""
    w = model.get_parameter(name).detach()
    flat = w.view(-1)
    if kind == "whole":
        w.mul_(0).add_(1)
        return 0, flat.numel()
    if kind == "middle":
        mid = flat.numel() // 2
        flat[mid : mid + 3] = torch.tensor([7.0, -7.0, 0.5])
        return mid, mid + 3
    w.mul_(2).add_(0.25)
    return 0, flat.numel()


def _expected_from_file(model_dir: str, written: dict[str, tuple[int, int]]) -> set[str]:
    """Names whose pages hold no written byte, from the checkpoint's byte offsets alone (transformers maps
    the file from offset 0 at a page boundary, so file offset ``o`` lies on page ``o // PAGE``)."""
    from accelerate_memsafe.io.safetensors_source import SafetensorsSource

    entries = SafetensorsSource(model_dir).entries
    dirty: set[int] = set()
    for name, (lo, hi) in written.items():
        e = entries[name]
        size = e.dtype.itemsize
        dirty.update(range((e.offset + lo * size) // PAGE, (e.offset + hi * size - 1) // PAGE + 1))
    return {n for n, e in entries.items() if not dirty & set(range(e.offset // PAGE, (e.offset + e.nbytes - 1) // PAGE + 1))}


def prepare_edited(rank: int, world_size: int, *, model_dir: str, edits: tuple[str, ...] = (), inv_freq_scale: float | None = None) -> dict[str, Any]:
    """Rank 0 loads with ``accelerate_memsafe.from_pretrained``, applies ``edits`` (keys of :data:`EDITS`)
    and optionally scales its rotary ``inv_freq`` in place; then ``prepare``. Returns every parameter's
    full value as every rank sees it, the buffers, the report, and (rank 0) what it expects."""
    from transformers import AutoModelForCausalLM

    import accelerate_memsafe

    acc, plugin = _accelerator({})
    model = accelerate_memsafe.from_pretrained(AutoModelForCausalLM, model_dir, dtype=torch.float32)
    out: dict[str, Any] = {}
    if rank == 0:
        written = {}
        with torch.no_grad():
            for kind in edits:
                written[EDITS[kind]] = _edit(model, kind, EDITS[kind])
            if inv_freq_scale is not None:
                model.model.rotary_emb.inv_freq.mul_(inv_freq_scale)
        out["expected"] = {n: p.detach().clone() for n, p in model.named_parameters()}
        out["expected_buffers"] = {n: b.detach().clone() for n, b in model.named_buffers()}
        out["expected_from_file"] = sorted(_expected_from_file(model_dir, written))
        out["page_offsets"] = {n: model.get_parameter(n).data_ptr() % PAGE for n in written}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, opt = acc.prepare(model, opt)
    out.update(_describe(model))
    # the full tensors, gathered on every rank (a collective: every rank calls it in the same order)
    out["full"] = {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}
    out["report"] = plugin.report.to_dict(timeline=False)
    return out


class RankDependentRecipe(nn.Module):
    """A parameter-free module whose ``reset_parameters`` gives a different value on each rank: rank 0's
    run reproduces rank 0's buffer, so the plan says "recipe", and rank 1's recomputed value differs."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.register_buffer("freq", torch.empty(dim), persistent=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        import torch.distributed as dist

        rank = dist.get_rank() if dist.is_initialized() else 0
        with torch.no_grad():
            self.freq.copy_(torch.arange(self.freq.numel(), dtype=torch.float32) + 100 * rank)

    def forward(self, x):
        return x * self.freq


class RankDependentModel(nn.Module):
    def __init__(self, dim: int = 16) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(dim, dim)
        self.freq = RankDependentRecipe(dim)

    def forward(self, x):
        return self.freq(self.lin(x))


def prepare_rank_dependent(rank: int, world_size: int) -> dict[str, Any]:
    """``prepare`` a model whose buffer recipe depends on the rank (after the Accelerator exists, so the
    recipe already sees its rank when the model is built)."""
    acc, plugin = _accelerator({})
    model = RankDependentModel()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = acc.prepare(model, opt)
    return {"freq": model.freq.freq.detach().clone(), "report": plugin.report.to_dict(timeline=False)}


def prepare_resized(rank: int, world_size: int, *, model_dir: str) -> dict[str, Any]:
    """``resize_token_embeddings`` before ``prepare``, each rank drawing its new rows from its own seed (as separate
    processes do without a common seed): transformers' load on every rank with the default ``mean_resizing``, for
    the plugin and for stock (``stages=[]``); ``accelerate_memsafe.from_pretrained`` with ``mean_resizing=False``
    (with the default, transformers reads the old rows' covariance on ``meta`` on the other ranks, and raises).
    Returns, per run, the full embedding every rank holds after ``prepare``; rank 0 also what it held before."""
    from accelerate.state import AcceleratorState, GradientState
    from transformers import AutoModelForCausalLM

    import accelerate_memsafe

    out: dict[str, Any] = {}
    for run, stages, loader, mean in (("plugin", None, "transformers", True), ("stock", [], "transformers", True),
                                      ("plugin_memsafe_loader", None, "memsafe", False)):
        acc, _ = _accelerator({"stages": stages}, efficient=False)
        model = (AutoModelForCausalLM.from_pretrained(model_dir) if loader == "transformers"
                 else accelerate_memsafe.from_pretrained(AutoModelForCausalLM, model_dir))
        torch.manual_seed(1000 + rank)
        model.resize_token_embeddings(model.config.vocab_size + 3, mean_resizing=mean)
        before = model.get_input_embeddings().weight.detach().clone() if rank == 0 else None
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        model, opt = acc.prepare(model, opt)
        out[run] = {"after": model.get_input_embeddings().weight.full_tensor().detach().clone(), "before": before}
        del acc, model, opt
        AcceleratorState._reset_state(reset_partial_state=False)
        GradientState._reset_state()
    return out


def prepare_new_head(rank: int, world_size: int, *, model_dir: str, cls_name: str, load_kwargs: dict,
                     runs: tuple[str, ...]) -> dict[str, Any]:
    """A checkpoint that lacks the loaded class's head (a base or masked-LM checkpoint under a classification head, or
    another number of labels with ``ignore_mismatched_sizes``), each rank drawing the new head from its own seed. Per
    run (see ``_NEW_HEAD_RUNS``): rank 0's parameters before ``prepare``, the full parameters every rank holds after it
    and after one AdamW step on a fixed batch, how many tensors were on ``meta``, whether the optimizer holds every
    parameter of the prepared model exactly once, or the error."""
    import accelerate
    import transformers
    from accelerate.state import AcceleratorState, GradientState
    from accelerate.utils import FullyShardedDataParallelPlugin

    import accelerate_memsafe
    from accelerate_memsafe import _compat

    cls = getattr(transformers, cls_name)
    g = torch.Generator().manual_seed(7)
    batch = {"input_ids": torch.randint(4, 90, (2, 10), generator=g), "labels": torch.tensor([0, 2])}
    out: dict[str, Any] = {}
    for run in runs:
        stages, loader, crel = _NEW_HEAD_RUNS[run]
        if stages == "stock":  # accelerate alone, its state switched to FSDP as the plugin does on CPU
            fsdp_plugin = FullyShardedDataParallelPlugin(fsdp_version=2, cpu_ram_efficient_loading=crel)
            acc = accelerate.Accelerator(cpu=True, fsdp_plugin=fsdp_plugin)
            _compat.promote_state_to_fsdp(fsdp_plugin)
        else:
            acc, _ = _accelerator({"stages": stages}, efficient=crel)
        torch.manual_seed(1000 + rank)
        try:
            model = (cls.from_pretrained(model_dir, **load_kwargs) if loader == "transformers"
                     else accelerate_memsafe.from_pretrained(cls, model_dir, **load_kwargs))
            before = {n: p.detach().clone() for n, p in model.named_parameters()} if rank == 0 else None
            on_meta = sum(p.is_meta for p in model.parameters())
            opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
            model, opt = acc.prepare(model, opt)
            after = {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}
            held = sorted(id(p) for group in opt.param_groups for p in group["params"])
            model.train()
            model(**batch).loss.backward()
            opt.step()
            stepped = {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}
            out[run] = {"before": before, "after": after, "stepped": stepped, "on_meta": on_meta,
                        "optimizer_exact": held == sorted(id(p) for p in model.parameters())}
        except Exception as exc:  # noqa: BLE001 - the test reads which runs refuse, and how
            out[run] = {"error": f"{type(exc).__name__}: {exc}"}
        del acc
        AcceleratorState._reset_state(reset_partial_state=False)
        GradientState._reset_state()
    return out


#: run -> (plugin stages (``None``: the default; ``"stock"``: accelerate without the plugin), loader, crel).
_NEW_HEAD_RUNS = {
    "plugin": (None, "transformers", False),
    "plugin_crel": (None, "transformers", True),
    "plugin_memsafe_loader": (None, "memsafe", True),
    "stock": ("stock", "transformers", False),
    "stock_crel": ("stock", "transformers", True),
    "no_stages_crel": ([], "transformers", True),
    "no_stages_crel_memsafe_loader": ([], "memsafe", True),
}


def prepare_from_config(rank: int, world_size: int) -> dict[str, Any]:
    """``accelerate_memsafe.from_config`` (training from scratch), each rank seeded differently, then ``prepare`` and
    one AdamW step on a fixed batch. Returns rank 0's initialisation, whether this rank's parameters were on ``meta``
    before ``prepare``, and the full parameters after ``prepare`` and after the step."""
    from transformers import AutoModelForCausalLM

    import accelerate_memsafe
    from accelerate_memsafe.models import llama_config

    acc, _ = _accelerator({})
    torch.manual_seed(1000 + rank)
    model = accelerate_memsafe.from_config(AutoModelForCausalLM, llama_config("tiny"))
    out: dict[str, Any] = {
        "on_meta": [p.is_meta for p in model.parameters()],
        "training": model.training,
        "before": {n: p.detach().clone() for n, p in model.named_parameters()} if rank == 0 else None,
    }
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, opt = acc.prepare(model, opt)
    out["after"] = {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}
    ids = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(7))
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    out["stepped"] = {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}
    return out


def prepare_classifier_family(rank: int, world_size: int, *, model_dir: str, cls_name: str) -> dict[str, Any]:
    """A family's ``...ForSequenceClassification`` (3 labels) from its LM checkpoint, each rank seeded differently,
    under ``transformer_based_wrap``: transformers' load on every rank with ``cpu_ram_efficient_loading`` and
    ``accelerate_memsafe.from_pretrained``. Per loader: rank 0's parameters before ``prepare``, the full parameters
    after it and after one AdamW step on a fixed batch."""
    import transformers
    from accelerate.state import AcceleratorState, GradientState
    from accelerate.utils import FullyShardedDataParallelPlugin

    import accelerate_memsafe
    from accelerate_memsafe import Accelerator, MemSafePlugin

    cls = getattr(transformers, cls_name)
    out: dict[str, Any] = {}
    for loader in ("transformers", "memsafe"):
        fsdp_plugin = FullyShardedDataParallelPlugin(fsdp_version=2, cpu_ram_efficient_loading=True,
                                                     auto_wrap_policy="transformer_based_wrap")
        acc = Accelerator(plugins=[MemSafePlugin()], fsdp_plugin=fsdp_plugin)
        torch.manual_seed(1000 + rank)
        model = (cls.from_pretrained(model_dir, num_labels=3) if loader == "transformers"
                 else accelerate_memsafe.from_pretrained(cls, model_dir, num_labels=3))
        before = {n: p.detach().clone() for n, p in model.named_parameters()} if rank == 0 else None
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        model, opt = acc.prepare(model, opt)
        after = {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}
        model.train()
        model(**classifier_batch()).loss.backward()
        opt.step()
        out[loader] = {"before": before, "after": after,
                       "stepped": {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}}
        del acc, model, opt
        AcceleratorState._reset_state(reset_partial_state=False)
        GradientState._reset_state()
    return out


def classifier_batch() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return {"input_ids": torch.randint(4, 60, (2, 10), generator=g), "labels": torch.tensor([0, 2])}
