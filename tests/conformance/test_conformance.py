"""Conformance of FSDP2 ``prepare`` across architecture families (GitHub issue #11).

By default a reduced set runs: every setting and every family kind at least once, all families in one
2-rank spawn, the 4-rank cells (``tp``, ``hsdp``, ``cp``) in a second (about two minutes on 2 cores). The full matrix
(``python -m tests.conformance``) is marked ``conformance`` and skipped unless ``MEMSAFE_CONFORMANCE=1`` or
``-m conformance``.
"""

from __future__ import annotations

import pytest

from . import families as fam
from . import matrix, worker
from .settings import BY_NAME

#: family -> settings of the reduced set (whisper last: a crash costs a re-spawn of what follows it).
REDUCED = {
    "phi3": ("tw", "size-bf16"),
    "llama3": ("hf-tw", "none", "ac"),
    "qwen3_moe": ("tw-bf16", "cp"),  # cp: FSDP 2 x CP 2 on 4 ranks, fused experts over the flattened dp_shard_cp
    "mistral": ("tw", "ac"),  # ac: sliding-window layers write the KV cache (stock fails in backward)
    "bert": ("size", "hf-none", "hsdp"),  # hsdp: 2 replicas of a 2-way FSDP on 4 ranks (stock fails: overlapping meshes)
    "bart": ("none-bf16",),
    "mamba": ("hf-tw-efficient",),
    "gpt2": ("offload",),
    "falcon_h1": ("size",),  # the mixer reads conv1d's weight directly (transformers' force_accelerate_hooks)
    "roberta-prelayernorm": ("tw",),  # _no_split_modules lists a cross-attention this config does not build
    "jetmoe": ("size",),  # the attention calls its experts' `map` / `reduce`, not their forward (read from the source)
    "gpt_neox_japanese": ("size",),  # the attention's forward returns its own bias parameter (read from the source)
    "qwen2": ("tp",),  # FSDP x TP on 4 ranks: the plan applied, the tied embedding and head kept replicated over tp
    "doge": ("tp",),  # a plan its forward does not run with (an unsplit per-head parameter): FSDP over dp_shard only
    "whisper": ("tw",),
}
CELLS = [(f, s) for f, settings in REDUCED.items() for s in settings]

pytestmark = pytest.mark.timeout(1200)  # the reduced set is ~1.5 min; a hang is cut at 60 + 30 s per cell


@pytest.fixture(scope="module")
def reduced(tmp_path_factory):
    root = tmp_path_factory.mktemp("conformance")
    families, dropped = fam.select(root, list(REDUCED))
    assert not dropped, f"reduced-set families no longer build: {dropped}"
    cells, _ = matrix.run([(f, list(REDUCED[f.name])) for f in families], root, pack=True, startup_s=60, cell_s=30)
    return families, {(c.family, c.setting): c for c in cells}


def test_reduced_set_covers_every_setting_and_kind(reduced):
    families, _ = reduced
    assert {s for _, s in CELLS} == set(BY_NAME)
    missing = set(fam.REQUIRED_KINDS) - {k for f in families for k in f.kinds}
    assert not missing, f"no family of the reduced set has kind(s) {sorted(missing)}"


@pytest.mark.parametrize(("family", "setting"), CELLS, ids=[f"{f}-{s}" for f, s in CELLS])
def test_reduced_cell(reduced, family, setting):
    cell = reduced[1][(family, setting)]
    assert cell.outcome != matrix.FAIL, f"{family} x {setting}: {cell.reason} (stock: {cell.stock})"


def test_the_tp_cells_apply_the_plan_where_the_forward_runs_with_it(reduced):
    applied = reduced[1][("qwen2", "tp")].facts["plugin"]["tp"]
    assert applied["tp_modules"] > 0 and "tp_declined" not in applied
    declined = reduced[1][("doge", "tp")].facts["plugin"]["tp"]
    assert declined["tp_modules"] == 0 and "does not run with its TP plan" in declined["tp_declined"]


def _facts(plugin_error=None, problems=(), stock_error=None):
    def path(error, probs):
        return {"error": error, "problems": list(probs), "elapsed": 0.0}

    return {"plugin": path(plugin_error, problems), "stock": path(stock_error, ())}


def test_classify():
    error = {"type": "ConfigError", "message": "no", "memsafe": True, "moved": False, "rank": 0, "all_ranks": True}
    crash = {"type": "ValueError", "message": "boom", "memsafe": False, "moved": True, "rank": 1, "all_ranks": False}
    assert matrix.classify("f", "s", _facts()).outcome == matrix.PASS
    assert matrix.classify("f", "s", _facts(problems=["1 tensor(s) differ"])).outcome == matrix.FAIL
    assert matrix.classify("f", "s", _facts(error, stock_error=crash)).outcome == matrix.REFUSED
    assert matrix.classify("f", "s", _facts(error)).outcome == matrix.FAIL  # refusing what stock can do
    assert matrix.classify("f", "s", _facts({**error, "moved": True}, stock_error=crash)).outcome == matrix.FAIL
    assert matrix.classify("f", "s", _facts(crash, stock_error=crash)).outcome == matrix.FAIL
    # cp: prepare conformed and the forward fails under accelerate's cp hooks as in one process: not the plugin's
    facts = _facts()
    facts["plugin"]["forward_fails_under_cp"] = "TypeError: forward() got an unexpected keyword argument 'is_causal'"
    cell = matrix.classify("f", "cp", facts)
    assert cell.outcome == matrix.NOT_RUN and "is_causal" in cell.reason
    facts["plugin"]["problems"] = ["rank 1: 1 tensor(s) differ from the reference: w"]
    assert matrix.classify("f", "cp", facts).outcome == matrix.FAIL


def test_settle_after_a_failed_spawn():
    f = fam.Family(name="f", model_type="f", auto_class="A", kinds=(), inputs={}, num_params=0, options={})
    tasks = [worker.Task(f, "a"), worker.Task(f, "b"), worker.Task(f, "c")]
    ok = {"error": None, "problems": []}

    def ev(event, setting, **kw):
        return {"event": event, "family": "f", "setting": setting, **kw}

    facts = {}
    events = [ev("start", "a", path="plugin"), ev("plugin", "a", plugin=ok), ev("start", "a", path="stock"),
              ev("abort", "a", path="stock", message="stock hung")]
    left = matrix._settle(tasks, events, "rank(s) [1] died", facts)
    assert facts[("f", "a")]["stock"]["error"]["message"] == "stock hung"
    assert [(t.setting, t.paths) for t in left] == [("b", worker.PATHS), ("c", worker.PATHS)]
    left = matrix._settle(left, [ev("start", "b", path="plugin"), ev("plugin", "b", plugin=ok), ev("restart", "b")],
                          "teardown", facts)
    assert [(t.setting, t.paths) for t in left] == [("b", ("stock",)), ("c", worker.PATHS)]
    assert matrix._settle(left, [], "import failed", facts) == []
    assert all(facts[("f", s)][p]["error"]["type"] == matrix.CRASH for s, p in [("b", "stock"), ("c", "plugin"), ("c", "stock")])


@pytest.mark.conformance
@pytest.mark.timeout(4 * 3600)
def test_full_matrix(tmp_path):
    families, _ = fam.select(tmp_path)
    cells, _ = matrix.run([(f, list(BY_NAME)) for f in families], tmp_path)
    failures = [f"{c.family} x {c.setting}: {c.reason}" for c in cells if c.outcome == matrix.FAIL]
    assert not failures, f"{len(failures)} of {len(cells)} cells FAIL:\n" + "\n".join(failures)
