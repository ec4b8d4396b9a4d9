"""``dataloader_resume``: exact resume of shuffled ``StatefulDataLoader``s on several processes."""

from __future__ import annotations

import weakref

from ..io import resume
from ..pipeline import HookContext, Stage, StageOutcome, ran, skipped


_BY_PLUGIN: dict[int, list[weakref.ref]] = {}


def _prepared_dataloaders(result) -> list:
    items = result if isinstance(result, (tuple, list)) else (result,)
    return [x for x in items if hasattr(x, "base_dataloader") or type(x).__name__.startswith("DataLoader")]


class DataLoaderResumeStage(Stage):
    """At ``prepare``, records the generator state at the start of each epoch of every prepared
    dataloader that shuffles; at ``save_state`` each process writes it (its own file); at ``load_state``,
    once accelerate restored the dataloaders, the generators are set back so that the replayed epoch has
    the order it had before the save (see :mod:`accelerate_memsafe.io.resume`).
    """

    name = "dataloader_resume"
    hooks = ("prepare", "save_state", "load_state")
    summary = "save/restore each rank's epoch-start sampler generator for an exact resume"

    @property
    def _dataloaders(self) -> list[weakref.ref]:
        # One stage instance per hook point: the dataloaders seen at `prepare` are shared through the plugin.
        key = id(self.options)
        if key not in _BY_PLUGIN:
            _BY_PLUGIN[key] = []
            weakref.finalize(self.options, _BY_PLUGIN.pop, key, None)
        return _BY_PLUGIN[key]

    def _alive(self) -> list:
        return [dl for ref in self._dataloaders if (dl := ref()) is not None]

    def run(self, ctx: HookContext) -> StageOutcome:
        if ctx.hook == "prepare":
            return ran()
        if not self._alive():
            return skipped("no prepared dataloader")
        if ctx.directory is None:
            return skipped("no checkpoint directory")
        if ctx.hook == "load_state":
            path = resume.state_file(ctx.directory, ctx.rank)
            if not path.exists():
                return skipped(f"the checkpoint has no {path.name} (written without the plugin)")
        return ran()

    def after(self, ctx: HookContext) -> StageOutcome:
        if ctx.hook == "prepare":
            new = _prepared_dataloaders(ctx.result)
            tracked = sum(resume.track_epoch_start(dl) is not None for dl in new)
            self._dataloaders.extend(weakref.ref(dl) for dl in new)
            return ran(dataloaders=len(new), shuffling=tracked)
        dls = self._alive()
        if ctx.hook == "save_state":
            path = resume.save_states(ctx.directory, ctx.rank, dls)
            return ran(dataloaders=len(dls), file=path.name)
        restored = resume.load_states(ctx.directory, ctx.rank, dls)
        return ran(dataloaders=restored)
