"""Workers for tests/distributed/test_fsdp_settings.py: FSDP2 settings users write (wrap policies,
activation checkpointing, ``cpu_offload=True``, mixed precision) and tied weights of every kind, each run
with the plugin and with accelerate's own path (``MemSafePlugin(stages=[])``) in the same process."""

from __future__ import annotations

import traceback
from typing import Any

import torch


def save_family(path: str, family: str) -> str:
    """A tiny random checkpoint of one family (fixed seed); returns the transformers auto class name."""
    import transformers as tf

    torch.manual_seed(0)
    if family == "llama_tied":
        cfg = tf.LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=True)
        model, auto = tf.LlamaForCausalLM(cfg), "AutoModelForCausalLM"
    elif family == "bert_mlm":  # decoder weight tied to the word embeddings, decoder bias tied to predictions.bias
        cfg = tf.BertConfig(vocab_size=97, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                            intermediate_size=64, max_position_embeddings=64)
        model, auto = tf.BertForMaskedLM(cfg), "AutoModelForMaskedLM"
    elif family == "t5":  # shared embedding used by the encoder, the decoder and the head
        cfg = tf.T5Config(vocab_size=97, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4, pad_token_id=0,
                          eos_token_id=1, decoder_start_token_id=0)
        model, auto = tf.T5ForConditionalGeneration(cfg), "AutoModelForSeq2SeqLM"
    elif family == "whisper":
        cfg = tf.WhisperConfig(vocab_size=97, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
                               decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, num_mel_bins=8,
                               max_source_positions=16, max_target_positions=32, pad_token_id=0, bos_token_id=1,
                               eos_token_id=2, decoder_start_token_id=1)
        model, auto = tf.WhisperForConditionalGeneration(cfg), "AutoModelForSpeechSeq2Seq"
    else:
        raise ValueError(family)
    model.save_pretrained(path)
    return auto


def _batch(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(3, 90, (2, 8), generator=g)
    if model.config.model_type == "whisper":
        feats = torch.randn(2, model.config.num_mel_bins, 2 * model.config.max_source_positions, generator=g)
        return {"input_features": feats, "labels": ids}
    return {"input_ids": ids, "labels": ids}


def _tie_groups(model: torch.nn.Module) -> list[list[str]]:
    from accelerate_memsafe.distributed.sharding import canonical_name

    groups: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        groups.setdefault(id(p), []).append(canonical_name(name))
    return sorted(sorted(g) for g in groups.values() if len(g) > 1)


def _full_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    from accelerate_memsafe.distributed.sharding import canonical_name

    out = {}
    for name, p in model.named_parameters():
        out[canonical_name(name)] = (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
    for name, b in model.named_buffers():
        out[canonical_name(name)] = b.detach().clone()
    return out


def _user_hooks(model: torch.nn.Module) -> dict[str, int]:
    """Hooks a script registers before ``prepare`` (a pre-hook and a hook on the input embeddings, a backward hook on
    the output embeddings); returns their call counts, filled as they fire."""
    calls = {"pre": 0, "forward": 0, "backward": 0}

    def count(key: str):
        def hook(*_: Any) -> None:
            calls[key] += 1
        return hook

    embed, head = model.get_input_embeddings(), model.get_output_embeddings()
    embed.register_forward_pre_hook(count("pre"))
    embed.register_forward_hook(count("forward"))
    if head is not None:
        head.register_full_backward_hook(count("backward"))
    return calls


def _run_cell(auto_name: str, model_dir: str, cell: dict[str, Any], *, stock: bool) -> dict[str, Any]:
    import transformers as tf
    from accelerate.state import AcceleratorState, GradientState
    from accelerate.utils import FullyShardedDataParallelPlugin, TorchDynamoPlugin

    import accelerate_memsafe
    from accelerate_memsafe import Accelerator, MemSafePlugin

    auto = getattr(tf, auto_name)
    kwargs = {"fsdp_version": 2, "cpu_ram_efficient_loading": True, **cell.get("fsdp", {})}
    try:
        acc = Accelerator(
            plugins=[MemSafePlugin(stages=[] if stock else None)],
            fsdp_plugin=FullyShardedDataParallelPlugin(**kwargs),
            mixed_precision=cell.get("mixed_precision", "no"),
            dynamo_plugin=TorchDynamoPlugin(**cell["dynamo"]) if "dynamo" in cell else None,
        )
        # stock: transformers' own load on every rank, as a user of stock accelerate writes it
        load = cell.get("load", {})
        model = auto.from_pretrained(model_dir, **load) if stock else accelerate_memsafe.from_pretrained(auto, model_dir, **load)
        hooks = _user_hooks(model)
        if "ignored_module_names" in cell:  # `FullyShardedDataParallelPlugin(ignored_modules=[modules])` of the model
            acc.state.fsdp_plugin.ignored_modules = [model.get_submodule(n) for n in cell["ignored_module_names"]]
        if "gradient_checkpointing" in cell:  # transformers' own (Trainer's `gradient_checkpointing=True`)
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=cell["gradient_checkpointing"])
        frozen = cell.get("freeze", ())  # name prefixes frozen before the optimizer takes the trainable rest
        for name, p in model.named_parameters():
            if name.startswith(tuple(frozen)):
                p.requires_grad_(False)
        trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        if cell.get("param_groups"):  # no weight decay on norms and biases, as training scripts group them
            groups = [{"params": [p for n, p in trainable if p.dim() > 1], "weight_decay": 0.1},
                      {"params": [p for n, p in trainable if p.dim() <= 1], "weight_decay": 0.0, "lr": 5e-4}]
        else:
            groups = [p for _, p in trainable] if frozen else model.parameters()
        opt = torch.optim.AdamW(groups, lr=1e-3)
        model, opt = acc.prepare(model, opt)
        state = _full_state(model)
        whole = sorted(n for n, p in model.named_parameters() if not hasattr(p, "full_tensor"))
        # the module tree as prepare leaves it: FSDP groups (FSDP* classes), checkpoint and offload wrappers
        tree = [(name, type(m).__name__) for name, m in model.named_modules()]
        ties = _tie_groups(model)
        batch = _batch(model)
        with torch.no_grad():
            loss = model(**batch).loss.float().item()
        model.train()
        model(**batch).loss.backward()
        opt.step()
        finite = all(bool(torch.isfinite(p.full_tensor() if hasattr(p, "full_tensor") else p).all()) for p in model.parameters())
        return {"ok": True, "state": state, "ties": ties, "loss": loss, "finite": finite, "whole": whole, "tree": tree,
                "hooks": dict(hooks),
                "trained": {n: t for n, t in _full_state(model).items() if t.is_floating_point()},
                "error": None, "dtypes": {n: str(t.dtype) for n, t in state.items()}}
    except Exception as exc:
        return {"ok": False, "error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}", "trace": traceback.format_exc()[-2000:]}
    finally:
        AcceleratorState._reset_state()
        GradientState._reset_state()


def run_cells(rank: int, world_size: int, *, model_dir: str, auto_name: str, cells: list[dict[str, Any]]) -> list[dict[str, Any]] | None:
    """Runs every cell with the plugin and with stock accelerate; rank 0 compares and returns a summary
    per cell (the other ranks' full tensors must equal rank 0's, checked by an all-gather of checksums)."""
    import torch.distributed as dist
    import transformers as tf

    ref = None
    if rank == 0:
        ref_model = getattr(tf, auto_name).from_pretrained(model_dir)
        ref = {"state": _full_state(ref_model), "ties": _tie_groups(ref_model), "hooks": _user_hooks(ref_model),
               "parameters": {n for n, _ in ref_model.named_parameters()}}
        with torch.no_grad():
            ref["loss"] = ref_model(**_batch(ref_model)).loss.float().item()
        ref_model.train()
        ref_model(**_batch(ref_model)).loss.backward()  # the cells' calls: a loss without grad, then a training step
    summaries = []
    for cell in cells:
        plugin = _run_cell(auto_name, model_dir, cell, stock=False)
        stock = _run_cell(auto_name, model_dir, cell, stock=True)
        # every rank must hold the same full tensors: compare a checksum of rank r's with rank 0's
        digest = torch.tensor([_digest(plugin.get("state", {}))], dtype=torch.float64)
        digests = [torch.zeros_like(digest) for _ in range(world_size)]
        dist.all_gather(digests, digest)
        if rank != 0:
            continue
        summary = {"cell": cell["id"], "plugin_error": plugin["error"], "stock_error": stock["error"],
                   "ranks_agree": len({float(d) for d in digests}) == 1}
        if plugin["ok"]:
            as_loaded = cell.get("mixed_precision", "no") == "no" and "load" not in cell  # the reference's dtypes
            expected = ref["state"] if as_loaded or not stock["ok"] else stock["state"]
            if not as_loaded and not stock["ok"]:  # the reference's parameters in the dtype the cell trains in
                dtype = torch.float32 if cell.get("mixed_precision", "no") != "no" else cell["load"].get("dtype", torch.float32)
                expected = {n: t.to(dtype) if t.is_floating_point() and n in ref["parameters"] else t
                            for n, t in ref["state"].items()}
            differ = [n for n, t in expected.items() if n not in plugin["state"] or not torch.equal(plugin["state"][n], t)]
            summary.update(
                differ=differ, missing=[n for n in expected if n not in plugin["state"]],
                ties=plugin["ties"], ref_ties=ref["ties"], loss=plugin["loss"], ref_loss=ref["loss"],
                stock_loss=stock.get("loss"), finite=plugin["finite"], whole=plugin["whole"],
                # the same module tree as stock's (where stock runs), but under torch.compile: accelerate compiles the
                # model `shard` wrapped, stock the one it then wraps (docs/prepare.md)
                tree_differs=stock["ok"] and "dynamo" not in cell and plugin["tree"] != stock["tree"],
                # the hooks the script registered before prepare fire, as often as under stock
                hooks=plugin["hooks"], stock_hooks=stock.get("hooks"), ref_hooks=dict(ref["hooks"]),
                # after one step, every weight bitwise stock's (where stock runs)
                trained_differ=[n for n, t in stock.get("trained", {}).items()
                                if n not in plugin["trained"] or not torch.equal(plugin["trained"][n], t)],
            )
        else:
            summary["plugin_trace"] = plugin["trace"]
        summaries.append(summary)
    return summaries if rank == 0 else None


def _digest(state: dict[str, torch.Tensor]) -> float:
    total = 0.0
    for i, name in enumerate(sorted(state)):
        t = state[name]
        if t.is_floating_point():
            total += float(t.double().sum()) * (i + 1) + float(t.double().abs().sum())
    return total


class QuantizedParam(torch.nn.Parameter):
    """Stands in for a quantized weight class (bitsandbytes' ``Params4bit``, torchao tensors)."""


def prepare_with_tensor_subclass(rank: int, world_size: int, *, model_dir: str) -> dict[str, Any]:
    """A model holding a tensor-subclass parameter: every rank must refuse before any weight moves."""
    import transformers as tf
    from accelerate.utils import FullyShardedDataParallelPlugin

    import accelerate_memsafe
    from accelerate_memsafe import Accelerator, MemSafePlugin

    acc = Accelerator(plugins=[MemSafePlugin()], fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=2))
    model = accelerate_memsafe.from_pretrained(tf.AutoModelForCausalLM, model_dir)
    mlp = model.model.layers[0].mlp
    mlp.up_proj.weight = QuantizedParam(mlp.up_proj.weight.detach(), requires_grad=False)
    before = {n: p for n, p in model.named_parameters()}
    try:
        acc.prepare(model, torch.optim.AdamW([p for p in model.parameters() if p.requires_grad]))
    except Exception as exc:
        unchanged = all(p is before[n] and (rank != 0 or not p.is_meta) for n, p in model.named_parameters())
        return {"error": f"{type(exc).__name__}: {exc}", "unchanged": unchanged}
    return {"error": None}


def prepare_channels_last(rank: int, world_size: int) -> dict[str, Any]:
    """A convolution model kept ``channels_last`` (non-contiguous parameters), prepared with the plugin and with stock
    (``stages=[]``), one step on the same batch on both ranks; and the same step in one process without FSDP."""
    from accelerate.state import AcceleratorState, GradientState
    from accelerate.utils import FullyShardedDataParallelPlugin

    from accelerate_memsafe import Accelerator, MemSafePlugin

    def build():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.ReLU(),
                                   torch.nn.Conv2d(8, 4, 3)).to(memory_format=torch.channels_last)

    x = torch.randn(2, 3, 8, 8, generator=torch.Generator().manual_seed(1)).to(memory_format=torch.channels_last)
    ref = build()
    before = {n: p.detach().clone() for n, p in ref.named_parameters()}
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    ref(x).square().mean().backward()
    ref_opt.step()
    out: dict[str, Any] = {"before": before, "ref_after": {n: p.detach().clone() for n, p in ref.named_parameters()}}
    for who in ("plugin", "stock"):
        acc = Accelerator(plugins=[MemSafePlugin(stages=[] if who == "stock" else None)],
                          fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=2))
        model = build()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        try:
            model, opt = acc.prepare(model, opt)
            prepared = {n: p.full_tensor().clone() for n, p in model.named_parameters()}
            acc.backward(model(x).square().mean())
            opt.step()
            out[who] = {"error": None, "prepared": prepared,
                        "after": {n: p.full_tensor().clone() for n, p in model.named_parameters()}}
        except Exception as exc:
            out[who] = {"error": f"{type(exc).__name__}: {exc}"}
        finally:
            AcceleratorState._reset_state(reset_partial_state=False)
            GradientState._reset_state()
    return out
