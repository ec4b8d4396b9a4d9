"""``offloaded_save``: save a model dispatched on cpu/disk shard by shard instead of accelerate's
``save_model``, which builds one full state dict in CPU memory (and transformers' ``save_pretrained``,
which can write a corrupted checkpoint when a many-to-one reverse conversion straddles two shards)."""

from __future__ import annotations

from pathlib import Path

from ..io import atomic
from ..io.offload_reader import OffloadedTensorReader, is_offloaded
from ..io.offloaded_save import save_offloaded, write_offloaded
from ..io.shard_plan import plan_offloaded_save, saveable_state_dict
from ..errors import PipelineError
from ..pipeline import HookContext, Stage, StageOutcome, ran
from ..sizes import parse_size


class OffloadedSaveStage(Stage):
    """Replaces accelerate's ``save_model`` for an offloaded model: plans shards so that every reverse
    weight conversion has its inputs in one shard, reads and reverts one conversion group at a time while
    writer threads put the previous ones into their files (bytes that already lie in a file read from
    there, each finished file fsynced in the background), checks the written headers against the plan, and
    puts the checkpoint in place only when complete.

    ``max_shard_size`` is the one passed to ``save_model`` if any, else the plugin's. When the
    ``atomic_checkpoint`` stage already redirected ``ctx.directory`` to a temporary directory, the files are
    written there and that stage swaps it into place; otherwise this stage does its own temporary directory
    and swap.
    """

    name = "offloaded_save"
    hooks = ("save_model",)
    summary = "save a cpu/disk-offloaded model shard by shard, conversion-aware, verified"

    def __init__(self, options) -> None:
        super().__init__(options)
        from . import DEFAULT_STAGES

        names = list(options.stages if options.stages is not None else DEFAULT_STAGES)
        # `atomic_checkpoint` must hand us its temporary directory; after us it would swap an empty one in.
        if "atomic_checkpoint" in names and names.index("atomic_checkpoint") > names.index(self.name):
            raise PipelineError([
                "`atomic_checkpoint` must run before `offloaded_save` (it redirects save_model to a temporary "
                "directory that offloaded_save writes into). HINT: move `atomic_checkpoint` before `offloaded_save`."
            ])

    def skip_reason(self, ctx: HookContext) -> str | None:
        if ctx.model is None or ctx.directory is None:
            return "no model or directory passed to save_model"
        from accelerate.utils import extract_model_from_parallel

        model = extract_model_from_parallel(ctx.model)
        if not is_offloaded(model):
            return "model is not offloaded"
        if ctx.kwargs.get("safe_serialization", True) is False:
            return "safe_serialization=False was requested; accelerate writes .bin files"
        if getattr(model, "hf_quantizer", None) is not None or getattr(model, "_hf_peft_config_loaded", False):
            return "quantized or PEFT models are saved by accelerate/transformers"
        return None

    def run(self, ctx: HookContext) -> StageOutcome:
        from accelerate.utils import extract_model_from_parallel

        model = extract_model_from_parallel(ctx.model)
        size = parse_size(ctx.kwargs.get("max_shard_size", self.options.max_shard_size), what="max_shard_size")
        ctx.skip_upstream = "offloaded_save wrote the checkpoint shard by shard"
        if ctx.rank != 0:
            return ran(writer=False)
        progress = bool(self.options.progress)
        if "atomic" in ctx.scratch or atomic.is_temp_dir(ctx.directory):
            # `atomic_checkpoint` owns the temporary directory and swaps it into place in its after().
            plan = plan_offloaded_save(model, size)
            reader = OffloadedTensorReader(model, saveable_state_dict(model))
            result = write_offloaded(model, Path(ctx.directory), plan, progress=progress, reader=reader)
        else:
            result = save_offloaded(model, ctx.directory, max_shard_size=size, progress=progress)
        ctx.result = None
        return ran(writer=True, **result.details())
