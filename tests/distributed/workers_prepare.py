"""Workers for tests/distributed/test_prepare_stages*.py (module level so that spawn can pickle them)."""

from __future__ import annotations

import os
import time
from typing import Any

import torch
from torch import nn

#: accelerate's variables under which transformers before 5.23 loads the weights on local rank 0 only and leaves zeros
#: on the other ranks, for accelerate's FSDP prepare to broadcast (``transformers.modeling_utils``, ``is_fsdp_enabled``)
_FSDP_EFFICIENT_LOADING_ENV = ("ACCELERATE_USE_FSDP", "FSDP_CPU_RAM_EFFICIENT_LOADING")


def single_process_load(auto, model_dir: str, **kwargs):
    """``auto.from_pretrained(model_dir)`` as one process loads it, outside accelerate's FSDP efficient-loading
    variables: the file's weights on every rank, so that a rank's result is compared with the checkpoint, not with
    whatever transformers does under those variables."""
    saved = {k: os.environ.pop(k) for k in _FSDP_EFFICIENT_LOADING_ENV if k in os.environ}
    try:
        return auto.from_pretrained(model_dir, **kwargs)
    finally:
        os.environ.update(saved)


VOCAB = 67  # odd: FSDP2 pads rank 1's shard of the embedding and the head (uneven rows)


class PersistentScale(nn.Module):
    """A module with a persistent buffer (in the state dict, so it is broadcast)."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.register_buffer("scale", torch.linspace(0.5, 1.5, dim), persistent=True)

    def forward(self, x):
        return x * self.scale


class NoRecipeTable(nn.Module):
    """A module whose non-persistent buffer has no init recipe (no reset_parameters, not transformers)."""

    def __init__(self, dim: int, seed: int) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.register_buffer("table", torch.randn(dim, generator=g), persistent=False)

    def forward(self, x):
        return x + self.table


class RecipeTable(nn.Module):
    """A parameter-free module whose non-persistent buffer is rebuilt by ``reset_parameters``."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.dim = dim
        self.register_buffer("freq", torch.empty(dim), persistent=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        with torch.no_grad():
            self.freq.copy_(1.0 / (10000 ** (torch.arange(self.dim, dtype=torch.float32) / self.dim)))

    def forward(self, x):
        return x * self.freq


class CustomModel(nn.Module):
    """Embedding -> scale (persistent buffer) -> table (non-persistent, no recipe) -> freq -> head."""

    def __init__(self, seed: int = 0, dim: int = 16) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.emb = nn.Embedding(VOCAB, dim)
        self.mid = nn.Linear(dim, dim)
        self.scale = PersistentScale(dim)
        self.table = NoRecipeTable(dim, seed)
        self.freq = RecipeTable(dim)
        self.head = nn.Linear(dim, VOCAB, bias=False)

    def forward(self, ids):
        h = self.freq(self.table(self.scale(self.mid(self.emb(ids)))))
        logits = self.head(h)
        return nn.functional.cross_entropy(logits.view(-1, VOCAB), ids.view(-1))


def batch(vocab: int, seed: int = 1234) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (2, 12), generator=g)


def _accelerator(plugin_kwargs: dict, *, mixed_precision: str = "no", cpu_offload: bool = False, efficient: bool = True,
                 parallelism: dict | None = None):
    from accelerate.utils import FullyShardedDataParallelPlugin, ParallelismConfig

    from accelerate_memsafe import Accelerator, MemSafePlugin

    kwargs: dict[str, Any] = {"fsdp_version": 2, "cpu_ram_efficient_loading": efficient}
    if cpu_offload:
        from torch.distributed.fsdp import CPUOffloadPolicy

        kwargs["cpu_offload"] = CPUOffloadPolicy(pin_memory=False)
    fsdp_plugin = FullyShardedDataParallelPlugin(**kwargs)
    plugin = MemSafePlugin(**plugin_kwargs)
    extra = {"parallelism_config": ParallelismConfig(**parallelism)} if parallelism else {}
    acc = Accelerator(plugins=[plugin], fsdp_plugin=fsdp_plugin, mixed_precision=mixed_precision, **extra)
    return acc, plugin


def _describe(model: nn.Module) -> dict[str, Any]:
    from torch.distributed.tensor import DTensor

    params = {}
    for name, p in model.named_parameters():
        local = p.to_local() if isinstance(p, DTensor) else p
        params[name] = {"local": local.detach().clone(), "dtype": str(p.dtype), "shape": tuple(p.shape)}
    buffers = {}
    for mod_name, mod in model.named_modules():
        for local, b in mod._buffers.items():
            if b is not None:
                fqn = f"{mod_name}.{local}" if mod_name else local
                buffers[fqn] = {"value": b.detach().clone(), "persistent": local not in mod._non_persistent_buffers_set}
    return {"params": params, "buffers": buffers}


def prepare_llama(
    rank: int,
    world_size: int,
    *,
    model_dir: str,
    loader: str = "memsafe",
    plugin_kwargs: dict | None = None,
    mixed_precision: str = "no",
    dtype: str = "float32",
    cpu_offload: bool = False,
    efficient: bool = True,
    track: bool = False,
    parallelism: dict | None = None,
    full: bool = False,
    edit: str | None = None,
    edit_on: int = 0,
    other_checkpoint_on: int | None = None,
    swap: tuple[str, str] | None = None,
    swap_on: int = 0,
    ranks_per_node: int | None = None,
    transport: str = "auto",
    tp_plan: dict[str, str] | None = None,
) -> dict[str, Any]:
    """Prepare a Llama checkpoint through the plugin; return shards, buffers, the loss, and (optionally)
    what the live-tensor tracker saw during ``prepare``, the mesh (``parallelism``: accelerate's
    ``ParallelismConfig`` sizes) and, with ``full``, each parameter's names whose full tensor differs from
    a single-process ``from_pretrained`` of the same checkpoint (``edit``: a parameter rank ``edit_on`` doubles in
    place after loading, in the reference too when that is rank 0; ``swap``: two parameters of one shape rank
    ``swap_on`` exchanges after loading (each still an unmodified view of the file, under the other's name), in the
    reference too when that is rank 0; ``other_checkpoint_on``: a rank that sees another checkpoint
    identity, as a node with its own copy of the files would; ``ranks_per_node``: the launcher's node index,
    ``GROUP_RANK``, as ``--num_machines`` would set it; ``transport="scatter"``: one ``scatter`` per bucket, the
    transport of the backends other than gloo, here over gloo; ``tp_plan``: the TP plan the model gets in place of
    its own, on every rank)."""
    from transformers import AutoModelForCausalLM

    if ranks_per_node:
        os.environ["GROUP_RANK"] = str(rank // ranks_per_node)
    if transport == "scatter":
        from accelerate_memsafe.distributed import scatter

        scatter.p2p_transport = lambda coll, nodes: False

    import accelerate_memsafe
    from accelerate_memsafe.memory.tracker import LiveTensorTracker

    acc, plugin = _accelerator(plugin_kwargs or {}, mixed_precision=mixed_precision, cpu_offload=cpu_offload, efficient=efficient,
                               parallelism=parallelism)
    torch_dtype = getattr(torch, dtype)
    if loader == "memsafe":
        model = accelerate_memsafe.from_pretrained(AutoModelForCausalLM, model_dir, dtype=torch_dtype)
    elif loader == "meta_rank1":  # stock transformers load on rank 0, meta elsewhere
        if rank == 0:
            model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch_dtype)
        else:
            from accelerate import init_empty_weights
            from transformers import AutoConfig

            with init_empty_weights(include_buffers=False):
                model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir), dtype=torch_dtype)
    else:
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch_dtype)
    if tp_plan is not None:
        model._tp_plan = dict(tp_plan)
    if edit and rank == edit_on:
        with torch.no_grad():
            model.get_parameter(edit).mul_(2)  # in place: the address stays the file's, the bytes do not
    if swap and rank == swap_on:
        (mod_a, _, attr_a), (mod_b, _, attr_b) = (n.rpartition(".") for n in swap)
        a, b = model.get_submodule(mod_a), model.get_submodule(mod_b)
        pa, pb = getattr(a, attr_a), getattr(b, attr_b)
        setattr(a, attr_a, pb)
        setattr(b, attr_b, pa)
    if other_checkpoint_on == rank:
        from accelerate_memsafe.distributed import local_read

        real = local_read.checkpoint_identity
        local_read.checkpoint_identity = lambda src: [(n, size, mtime + 1, h) for n, size, mtime, h in real(src)]
    full_shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    allocs: list[tuple[str, tuple[int, ...], int]] = []

    def on_alloc(func: str, t: torch.Tensor) -> None:
        allocs.append((func, tuple(t.shape), t.untyped_storage().nbytes()))

    tracker = LiveTensorTracker(on_alloc=on_alloc) if track else None
    # which thread releases each of rank 0's source tensors (the prefetch thread frees what it copied)
    import threading

    from accelerate_memsafe.distributed.source import Rank0Source

    releases: list[tuple[str, str]] = []
    real_release = Rank0Source.release

    def release(self, name: str) -> None:
        releases.append((name, threading.current_thread().name))
        real_release(self, name)

    Rank0Source.release = release
    # whether Python's cyclic collector ran during the distribution (it must not: a full collection stalls every rank)
    import gc

    from accelerate_memsafe.stages import rank0_distribute as distribute_stage

    gc_during: list[bool] = []
    real_distribute = distribute_stage.distribute_from_rank0

    def distribute(*args, **kwargs):
        gc_during.append(gc.isenabled())
        return real_distribute(*args, **kwargs)

    distribute_stage.distribute_from_rank0 = distribute
    try:
        if tracker is not None:
            with tracker:
                model, opt = acc.prepare(model, opt)
        else:
            model, opt = acc.prepare(model, opt)
    finally:
        Rank0Source.release = real_release
        distribute_stage.distribute_from_rank0 = real_distribute
    out = _describe(model)
    out["releases"] = releases
    out["gc_enabled_during_distribution"], out["gc_enabled_after"] = gc_during, gc.isenabled()
    if full:  # every rank ends with rank 0's (here: the file's) weights, whatever the mesh
        reference_model = single_process_load(AutoModelForCausalLM, model_dir, dtype=torch_dtype)
        with torch.no_grad():
            ids = batch(reference_model.config.vocab_size)
            out["single_process_loss"] = reference_model(input_ids=ids, labels=ids).loss.float().item()
        reference = reference_model.state_dict()
        if edit and edit_on == 0:  # rank 0's model is the truth: another rank's edit is not
            reference[edit] = reference[edit] * 2
        if swap and swap_on == 0:
            reference[swap[0]], reference[swap[1]] = reference[swap[1]], reference[swap[0]]
        out["differs_from_single_process"] = [n for n, p in model.named_parameters()
                                              if not torch.equal(p.full_tensor(), reference[n])]
        out["placements"] = {n: str(p.placements) for n, p in model.named_parameters()}
    tied = getattr(model, "lm_head", None) is not None and model.lm_head.weight is model.model.embed_tokens.weight
    opt_ok = all(any(q is p for p in model.parameters()) for g in opt.param_groups for q in g["params"])
    ids = batch(model.config.vocab_size)
    with torch.no_grad():
        loss = model(input_ids=ids, labels=ids).loss.float().item()
    # one training step works (gradients flow through the distributed shards)
    model.train()
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    out.update(
        loss=loss,
        tied=tied,
        opt_ok=opt_ok,
        full_shapes=full_shapes,
        allocs=allocs,
        tracker_peak=tracker.peak_bytes if tracker else None,
        report=plugin.report.to_dict(timeline=False),
    )
    return out


def prepare_custom(rank: int, world_size: int, *, plugin_kwargs: dict | None = None, meta_on_rank1: bool = True) -> dict[str, Any]:
    """Prepare :class:`CustomModel` where rank 1's weights and no-recipe buffer differ from rank 0's."""
    acc, plugin = _accelerator(plugin_kwargs or {})
    if rank != 0 and meta_on_rank1:
        from accelerate import init_empty_weights

        with init_empty_weights(include_buffers=False):
            model = CustomModel(seed=100 + rank)
    else:
        model = CustomModel(seed=100 + rank if rank else 0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = acc.prepare(model, opt)
    out = _describe(model)
    with torch.no_grad():
        out["loss"] = model(batch(VOCAB)).item()
    out["report"] = plugin.report.to_dict(timeline=False)
    return out


def prepare_killed(rank: int, world_size: int, *, model_dir: str, timeout_s: float, die_after: int = 2, hang: bool = False) -> dict[str, Any]:
    """Rank 1 exits (or, with ``hang``, stalls) in the middle of the scatter; rank 0 must fail with a
    clear error within the timeout."""
    from transformers import AutoModelForCausalLM

    import accelerate_memsafe
    from accelerate_memsafe.distributed import collectives

    acc, _ = _accelerator({"collective_timeout_s": timeout_s, "bucket_bytes": 64 * 1024, "prefetch_buckets": 1, "load_source": "rank0"})
    model = accelerate_memsafe.from_pretrained(AutoModelForCausalLM, model_dir, dtype=torch.float32)
    if rank == 1:
        real = collectives.Collectives.exchange_async
        calls = {"n": 0}

        def dying_scatter(self, *args, **kwargs):
            calls["n"] += 1
            if calls["n"] > die_after:
                if not hang:
                    os._exit(17)
                time.sleep(3 * timeout_s)
            return real(self, *args, **kwargs)

        collectives.Collectives.exchange_async = dying_scatter
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    start = time.monotonic()
    try:
        acc.prepare(model, opt)
    except Exception as exc:
        return {"error": type(exc).__name__, "message": str(exc), "elapsed": time.monotonic() - start}
    return {"error": None, "elapsed": time.monotonic() - start}


def from_pretrained_before_accelerator(rank: int, world_size: int, *, model_dir: str) -> str:
    """``from_pretrained`` before the process group exists must raise a clear error."""
    from transformers import AutoModelForCausalLM

    import accelerate_memsafe

    try:
        accelerate_memsafe.from_pretrained(AutoModelForCausalLM, model_dir)
    except accelerate_memsafe.ConfigError as exc:
        return str(exc)
    return "no error"


def prepare_meta_without_filling_stages(rank: int, world_size: int, *, model_dir: str) -> list[dict[str, Any]]:
    """``accelerate_memsafe.from_pretrained`` (rank 1 on meta) with pipelines that do not fill meta weights:
    ``stages=[]`` with ``cpu_ram_efficient_loading=True`` (where stock accelerate before 1.16 trains on the wrong
    tensors and DCP fails at the first save), a stage list without the prepare stages, and ``stages=[]`` without
    that setting (where stock fills nothing). Per run: the error and message, whether the parameters are unchanged
    (or, where it went through, all DTensors), and how many records the report holds."""
    from accelerate.state import AcceleratorState, GradientState
    from torch.distributed.tensor import DTensor
    from transformers import AutoModelForCausalLM

    import accelerate_memsafe

    out = []
    for stages, efficient in (([], True), (["atomic_checkpoint", "dataloader_resume"], True), ([], False)):
        acc, plugin = _accelerator({"stages": stages}, efficient=efficient)
        model = accelerate_memsafe.from_pretrained(AutoModelForCausalLM, model_dir, dtype=torch.float32)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        before = {n: (type(p).__name__, p.device.type) for n, p in model.named_parameters()}
        try:
            model, opt = acc.prepare(model, opt)
            error = message = None
        except Exception as exc:
            error, message = type(exc).__name__, str(exc)
        after = {n: (type(p).__name__, p.device.type) for n, p in model.named_parameters()}
        out.append({"stages": stages, "efficient": efficient, "error": error, "message": message,
                    "unchanged": before == after, "sharded": all(isinstance(p, DTensor) for p in model.parameters()),
                    "records": len(plugin.report.records)})
        del acc
        AcceleratorState._reset_state(reset_partial_state=False)
        GradientState._reset_state()
    return out


def prepare_model_alone(rank: int, world_size: int, *, model_dir: str, runs: tuple[str, ...]) -> dict[str, Any]:
    """FSDP2 ``prepare(model)`` without its optimizer (accelerate 1.16 on), under ``transformer_based_wrap`` and
    activation checkpointing: the logits of an evaluation forward, then (the groups resharded) an AdamW optimizer
    built from the sharded parameters and ``prepare(model, optimizer)`` called again, one step: the full parameters
    after it, the prepare records of the report, or the error of the first call. Per run: ``(stages, loader)``, ``stages`` ``"stock"`` for
    ``MemSafePlugin(stages=[])``, ``loader`` transformers' ``from_pretrained`` or the plugin's."""
    from accelerate.state import AcceleratorState, GradientState
    from accelerate.utils import FullyShardedDataParallelPlugin
    from torch.distributed.tensor import DTensor
    from transformers import AutoModelForCausalLM

    import accelerate_memsafe
    from accelerate_memsafe import Accelerator, MemSafePlugin

    ids = batch(VOCAB)
    out: dict[str, Any] = {}
    for run in runs:
        stages, loader = {"plugin": (None, "transformers"), "plugin_memsafe_loader": (None, "memsafe"),
                          "stock": ([], "transformers")}[run]
        fsdp = FullyShardedDataParallelPlugin(fsdp_version=2, cpu_ram_efficient_loading=True,
                                              auto_wrap_policy="transformer_based_wrap", activation_checkpointing=True)
        plugin = MemSafePlugin(stages=stages)
        acc = Accelerator(plugins=[plugin], fsdp_plugin=fsdp)
        torch.manual_seed(1000 + rank)
        model = (AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32) if loader == "transformers"
                 else accelerate_memsafe.from_pretrained(AutoModelForCausalLM, model_dir, dtype=torch.float32))
        try:
            model = acc.prepare(model)
        except ValueError as exc:
            out[run] = {"error": str(exc)}
        else:
            model.eval()
            with torch.no_grad():
                logits = model(input_ids=ids).logits.detach().clone()
            # FSDP2 keeps the groups made with reshard_after_forward=False (the root, accelerate's [norm, head] tail)
            # gathered after a forward: shard them again before building the optimizer from the parameters
            from torch.distributed.fsdp import FSDPModule

            for m in model.modules():
                if isinstance(m, FSDPModule):
                    m.reshard()
            model.train()
            opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
            model, opt = acc.prepare(model, opt)
            acc.backward(model(input_ids=ids, labels=ids).loss)
            opt.step()
            full = {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone() for n, p in model.named_parameters()}
            held = sorted(id(p) for g in opt.param_groups for p in g["params"])
            out[run] = {"logits": logits, "stepped": full, "optimizer_exact": held == sorted(id(p) for p in model.parameters()),
                        "records": [(r.stage, r.status) for r in plugin.report.records if r.hook == "prepare"]}
        del acc
        AcceleratorState._reset_state(reset_partial_state=False)
        GradientState._reset_state()
    return out
