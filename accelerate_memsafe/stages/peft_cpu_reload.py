"""``peft_cpu_reload``: on ``load_state``, reload a PEFT model CPU-first, tensor by tensor, in place.

Where the weights come from. accelerate's ``save_state`` writes ``model.safetensors`` (``model_{i}`` for
the i-th model) holding the prepared model's whole ``state_dict()`` under its own key names: for a
``PeftModel`` that is ``base_model.model.<...>.lora_A.<adapter>.weight``, the ``modules_to_save`` copies and
the frozen base weights. The stage reads exactly that file, keyed by the prepared model's own
``state_dict(keep_vars=True)`` names, so no peft key translation is needed; every tensor (adapters and
base) is copied into the existing tensor in place, which restores what accelerate's own load would, with
at most one tensor of extra memory instead of the whole file on the load device. accelerate's model load
is then skipped (``upstream_skips_models``); optimizers, schedulers, RNG states and custom objects are
still loaded by accelerate (or by the ``optimizer_cpu_reload`` stage).

peft's own ``save_pretrained`` layout (``adapter_model.safetensors``, other adapters in subfolders) is what
:func:`accelerate_memsafe.reload_adapter` and the Trainer integration read.

Not handled here (skipped, accelerate loads as usual): no PEFT model; FSDP (accelerate's
``load_fsdp_model`` reads its own sharded format in place before any hook runs); several prepared models;
no ``model.safetensors`` (pickle ``.bin``); no explicit ``input_dir``.
"""

from __future__ import annotations

from pathlib import Path

from ..integrations.peft import copy_file_into, empty_device_caches, find_peft_model, plan_state_dict_file
from ..pipeline import HookContext, Stage, StageOutcome, ran


class PeftCpuReloadStage(Stage):
    """Reloads a prepared ``PeftModel`` from accelerate's ``model.safetensors`` one tensor at a time, in
    place, CPU-first (pinned, non-blocking on CUDA). ``run`` validates the whole file (and the device
    memory) before anything changes and tells accelerate's ``load_state`` not to read the model file;
    ``after`` copies, once accelerate has loaded the rest without error.
    """

    name = "peft_cpu_reload"
    hooks = ("load_state",)
    summary = "reload PEFT models in place from model.safetensors, one tensor at a time, CPU-first"

    def skip_reason(self, ctx: HookContext) -> str | None:
        # the stage issues no collective: a rank-local check (the file) may decide on its own
        if not any(find_peft_model(m) is not None for m in ctx.models):  # imports nothing (no peft import)
            return "no PEFT model"
        if ctx.is_fsdp2 or ctx.fsdp_plugin is not None:
            return "FSDP: accelerate's load_fsdp_model reads the sharded checkpoint in place"
        if len(ctx.models) != 1:
            return f"{len(ctx.models)} prepared models: accelerate loads them (one PEFT model is handled)"
        if ctx.directory is None:
            return "no input_dir given: accelerate resolves the latest automatic checkpoint itself"
        if not (Path(ctx.directory).expanduser() / "model.safetensors").is_file():
            return f"no model.safetensors in {ctx.directory} (pickle checkpoints are loaded by accelerate)"
        return None

    def run(self, ctx: HookContext) -> StageOutcome:
        path = Path(ctx.directory).expanduser() / "model.safetensors"
        model = ctx.models[0]
        # Validate now (before anything changes); copy once accelerate has loaded the rest.
        plan = plan_state_dict_file(model, path, check_memory=self.options.preflight_memory_check)
        ctx.scratch["peft_reload_plan"] = (path, plan)
        ctx.scratch["upstream_skips_models"] = True
        return ran(file=str(path), tensors=len(plan), adapters=list(find_peft_model(model).peft_config))

    def after(self, ctx: HookContext) -> StageOutcome:
        path, plan = ctx.scratch.pop("peft_reload_plan")
        empty_device_caches()
        stats = copy_file_into(path, plan)
        return ran(bytes=stats.bytes, largest_tensor_bytes=stats.largest_tensor_bytes, device=stats.device)
