"""``dataloader_resume``: exact resume of shuffled ``StatefulDataLoader``s on several processes."""

from __future__ import annotations

import weakref

from torch.utils.data import DataLoader

from ..io import atomic, resume
from ..pipeline import HookContext, Stage, StageOutcome, ran, skipped


_BY_PLUGIN: dict[int, list[weakref.ref]] = {}
# States read at `load_state` for dataloaders not prepared yet, by prepare index: (ours, accelerate's).
_PENDING: dict[int, dict[int, tuple[dict, dict | None]]] = {}


def _prepared_dataloaders(result) -> list:
    items = result if isinstance(result, (tuple, list)) else (result,)
    return [x for x in items if hasattr(x, "base_dataloader") or type(x).__name__.startswith("DataLoader")]


class DataLoaderResumeStage(Stage):
    """At ``prepare``, records the generator state at the start of each epoch of every prepared
    dataloader that shuffles; at ``save_state`` each process writes it (its own file); at ``load_state``,
    once accelerate restored the dataloaders, the generators are set back so that the replayed epoch has
    the order it had before the save (see :mod:`accelerate_memsafe.io.resume`).

    Dataloaders are paired by their position in ``prepare`` order, as accelerate pairs its own
    ``dl_state_dict_<i>.bin``. A checkpoint holding more dataloaders than are prepared at ``load_state``
    keeps the rest: a dataloader prepared later at that position gets its state (accelerate's and ours)
    when it is prepared.
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
            _PENDING[key] = {}
            weakref.finalize(self.options, _BY_PLUGIN.pop, key, None)
            weakref.finalize(self.options, _PENDING.pop, key, None)
        return _BY_PLUGIN[key]

    @property
    def _pending(self) -> dict[int, tuple[dict, dict | None]]:
        self._dataloaders  # noqa: B018 - creates both entries
        return _PENDING[id(self.options)]

    def _by_index(self) -> dict[int, object]:
        return {i: dl for i, ref in enumerate(self._dataloaders) if (dl := ref()) is not None}

    def _alive(self) -> list:
        return [dl for ref in self._dataloaders if (dl := ref()) is not None]

    def skip_reason(self, ctx: HookContext) -> str | None:
        if ctx.hook == "prepare":
            return None if any(isinstance(a, DataLoader) for a in ctx.args) else "no dataloader passed to prepare"
        if ctx.directory is None:
            return "no checkpoint directory"
        if ctx.hook == "save_state" and not self._alive():
            return "no prepared dataloader"
        return None

    def run(self, ctx: HookContext) -> StageOutcome:
        if ctx.hook != "load_state":
            return ran()
        # what the checkpoint holds is read here, not in skip_reason: a load drops the states still pending
        # from an earlier one whether or not this checkpoint has states of its own
        self._pending.clear()
        path = resume.state_file(ctx.directory, ctx.rank)
        saved = atomic.saved_world_size(ctx.directory)
        if saved is not None and saved != ctx.world_size:
            return skipped(f"the checkpoint was written by {saved} process(es), this run has {ctx.world_size}: "
                           "each rank's epoch-start generator belongs to the old split of the data")
        if not path.exists():
            return skipped(f"the checkpoint has no {path.name} (written without the plugin)")
        return ran()

    def after(self, ctx: HookContext) -> StageOutcome:
        if ctx.hook == "prepare":
            new = _prepared_dataloaders(ctx.result)
            tracked = sum(resume.track_epoch_start(dl) is not None for dl in new)
            first = len(self._dataloaders)
            self._dataloaders.extend(weakref.ref(dl) for dl in new)
            late = {i: dl for i, dl in enumerate(new, start=first) if i in self._pending}
            for i, dl in late.items():
                _, upstream = self._pending[i]
                if upstream is not None and getattr(dl, "use_stateful_dataloader", False):
                    dl.load_state_dict(upstream)
            restored = resume.apply_states({i: self._pending.pop(i)[0] for i in late}, late, source="the loaded checkpoint")
            return ran(dataloaders=len(new), shuffling=tracked, restored=len(restored))
        if ctx.hook == "save_state":
            dls = self._alive()
            path = resume.save_states(ctx.directory, ctx.rank, dls)
            return ran(dataloaders=len(dls), file=path.name)
        states = dict(enumerate(resume.read_states(ctx.directory, ctx.rank) or []))
        restored = resume.apply_states(states, self._by_index(), source=str(ctx.directory))
        later = {i: (st, resume.read_upstream_dataloader_state(ctx.directory, i))
                 for i, st in states.items() if i >= len(self._dataloaders)}
        self._pending.update(later)
        return ran(dataloaders=len(restored), pending=len(later))
